"""Configuration mistakes, reported as one line naming the flag and the fix.

    error: --bf16 and --fp16 are exclusive: choose one

A run's entry point (apps/gpt's pretrain) loads its configuration with
`load_config` (entry_point.py): a bad option, a dataclass's `__post_init__`
refusal or a `validate` rule becomes a ConfigError whose message speaks of
command-line flags (`tensor_model_parallel_size=3` reads
`--tensor-model-parallel-size 3`). Every rank parses the same command line and
finds the same mistake, so every rank exits with status 2 and only rank 0
prints (RANK from the launcher's environment before torch.distributed starts),
without a traceback: no rank waits for one that left.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import torch.distributed as dist

__all__ = [
    "EXIT_STATUS",
    "GRACE_SECONDS",
    "ConfigError",
    "as_flags",
    "config_errors",
    "flag",
    "launch_rank",
    "report",
]

EXIT_STATUS = 2
"""A configuration mistake's exit status (argparse's for a bad command line)."""

GRACE_SECONDS = 5.0
"""How long a rank other than 0 waits before it exits with a mistake rank 0 reports."""


class ConfigError(ValueError):
    """A configuration mistake the user can fix; the message names the flag and the fix."""


def flag(name: str) -> str:
    """A field's command-line flag: lr_warmup_iters -> --lr-warmup-iters."""
    return "--" + name.replace("_", "-")


# name=value, where value is a quoted word, a list, or a run of characters up to a space
# or a closing punctuation mark.
_ASSIGNMENT = re.compile(r"(?<![\w-])([a-z][a-z0-9_]*)=('[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s,;:)]+)")
_WORD = re.compile(r"(?<![\w.-])([a-z][a-z0-9_]*)(?![\w=-])")
_BARE = {"bf16", "fp16"}  # field names without an underscore that read as flags alone


def as_flags(message: str, fields: set[str] | frozenset[str]) -> str:
    """`message` with the configuration fields it names written as flags: `name=value`
    becomes `--name value` (`--name` for True, `--no-name` for False) and a bare name with
    an underscore (or bf16, fp16) becomes `--name`."""

    def assignment(match: re.Match) -> str:
        name, value = match.groups()
        if name not in fields:
            return match.group(0)
        if value == "True":
            return flag(name)
        if value == "False":
            return "--no-" + name.replace("_", "-")
        return f"{flag(name)} {value.strip(chr(39) + chr(34))}"

    def word(match: re.Match) -> str:
        name = match.group(1)
        known = name in fields and ("_" in name or name in _BARE)
        return flag(name) if known else name

    return _WORD.sub(word, _ASSIGNMENT.sub(assignment, message))


@contextmanager
def config_errors(fields: set[str] | frozenset[str]) -> Iterator[None]:
    """Turns a ValueError raised inside (a configuration rule's refusal) into a
    ConfigError speaking of flags, and an OSError (a --config file or a checkpoint that
    is not there) into one naming the file."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as error:
        message = str(error)
        if isinstance(error, OSError) and error.filename is not None:
            message = f"{error.filename}: {error.strerror}"
        raise ConfigError(as_flags(" ".join(message.split()), fields)) from error


def launch_rank(environ=os.environ) -> int:
    """This process's global rank as the launcher (torchrun) set it; 0 alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(environ.get("RANK", 0))


def report(error: ConfigError, stream: TextIO | None = None) -> int:
    """Prints `error: MESSAGE` on rank 0 and returns the exit status. The other ranks
    found the same mistake: they stay silent and wait GRACE_SECONDS before returning, as
    torchrun stops every rank once one has exited, and rank 0 may be a little behind."""
    if launch_rank() == 0:
        sys.stdout.flush()
        print(f"error: {error}", file=stream or sys.stderr, flush=True)
    else:
        time.sleep(GRACE_SECONDS)
    return EXIT_STATUS
