"""Python logging for a run, configured once when it initializes.

    2026-11-24 16:20:03 [rank 0] INFO mp_train: torch.distributed initialized: world size 2, ...

Every package logs through `logging.getLogger("mp_<package>")`. configure_logging
puts one handler (stderr, a line naming the time, the rank, the level and the
logger) on those loggers. Rank 0 and the last rank (where the training log lines
come from) show records from `--logging-level` up (Megatron's flag: a number such
as 20, or a name such as INFO or debug; INFO by default); the other ranks show
warnings and errors only, so that N ranks do not print N copies of each line.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["LOGGERS", "configure_logging", "parse_level"]

LOGGERS = ("mp_state", "mp_ckpt", "mp_data", "mp_layers", "mp_optim", "mp_pipeline",
           "mp_train", "mp_gpt")  # fmt: skip
"""The loggers configured: one per package, and the GPT application's."""

DEFAULT_LEVEL = logging.INFO


class _RunHandler(logging.StreamHandler):
    """The handler configure_logging adds (recognized, and replaced, when called again).
    Without a stream it writes to sys.stderr as it is at each record (a test may swap it)."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self.follows_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self.follows_stderr:
            self.stream = sys.stderr
        super().emit(record)


def parse_level(text: str | int) -> int:
    """--logging-level's value: a number (20) or a name (INFO, info)."""
    if isinstance(text, int):
        return text
    word = text.strip()
    if word.lstrip("-").isdigit():
        return int(word)
    level = logging.getLevelName(word.upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a logging level: give a number (10, 20, 30) or a name "
            "(DEBUG, INFO, WARNING, ERROR)"
        )
    return level


def configure_logging(level: int | None, rank: int, world_size: int, stream=None) -> None:
    """Shows the mp loggers' records on `stream` (stderr): from `level` (INFO when None)
    up on rank 0 and the last rank, from WARNING up elsewhere. Calling it again replaces
    what the previous call set."""
    level = DEFAULT_LEVEL if level is None else level
    shown = level if rank in (0, world_size - 1) else max(level, logging.WARNING)
    handler = _RunHandler(stream)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
            datefmt="%Y-%m-%d %H:%M:%S",
        )
    )
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _RunHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(shown)
