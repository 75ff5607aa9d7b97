"""The one exception a command raises for a problem the user can fix.

`main` prints a CliError as one line, "mp-data COMMAND: error: MESSAGE", on
stderr and exits with status 1: bad input, a missing file or an unusable
option is an expected outcome, not a bug, so it gets no traceback. Anything
else (a bug) keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """A user-facing error; the message names the file, line, option or value at fault."""
