"""Progress of long work (preprocess, merge), for a person at a terminal or a log.

    with progress(len(prefixes), "merge", unit="dataset") as bar:
        for ... :
            bar.update()

On a terminal (the stream is a tty) a tqdm bar, redrawn in place. Elsewhere
(a job's log file, a pipe) plain lines, never a carriage return: one each
time the work passes another tenth of its total, or LINE_SECONDS after the
last line when the total is unknown or a tenth takes long, and one at the end.
`enabled=False` shows nothing. mp-ckpt has the same helper (mp_ckpt.core.progress):
each package installs alone, so neither imports the other.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["LINE_SECONDS", "is_terminal", "progress"]

LINE_SECONDS = 30.0
"""Off a terminal, the longest time between two lines."""


def progress(total: int | None, description: str, *, unit: str = "it",
             stream: TextIO | None = None, enabled: bool = True):  # fmt: skip
    """A progress reporter with tqdm's update(n=1), set_postfix_str(text) and close(),
    usable as a context manager: a bar on a terminal, lines elsewhere (module docstring)."""
    stream = sys.stderr if stream is None else stream
    if enabled and not is_terminal(stream):
        return _Lines(total, description, unit, stream)
    return tqdm(total=total, desc=description, unit=unit, file=stream, disable=not enabled,
                dynamic_ncols=True, leave=True)  # fmt: skip


class _Lines:
    """Plain periodic lines: `DESCRIPTION: 12/40 tensors (30%), 4 s[, postfix]`."""

    def __init__(self, total: int | None, description: str, unit: str, stream: TextIO) -> None:
        self.total, self.description, self.unit, self.stream = total, description, unit, stream
        self.n, self.postfix = 0, ""
        self.start = self._last_line = time.monotonic()
        self._next_tenth = 1
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        tenth = 10 * self.n // self.total if self.total else 0
        if tenth >= self._next_tenth and self.n < (self.total or 0):
            self._next_tenth = tenth + 1
            self._line(now)
        elif now - self._last_line >= LINE_SECONDS:
            self._line(now)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line(time.monotonic(), done=True)

    def _line(self, now: float, done: bool = False) -> None:
        self._last_line = now
        count = f"{self.n}/{self.total}" if self.total else str(self.n)
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        text = f"{self.description}: {count} {self.unit}s{share}, {now - self.start:.0f} s"
        text += (", " + self.postfix if self.postfix else "") + (", done" if done else "")
        self.stream.write(text + "\n")
        self.stream.flush()


def is_terminal(stream) -> bool:
    """Whether `stream` is a terminal (a tty)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
