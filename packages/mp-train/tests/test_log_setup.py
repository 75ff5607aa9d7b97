"""configure_logging: one handler on the mp loggers, the level on rank 0 and the last rank,
warnings only elsewhere; --logging-level takes a number or a name."""

from __future__ import annotations

import argparse
import io
import logging

import pytest

from mp_train import parse_config
from mp_train.observability.log_setup import LOGGERS, configure_logging, parse_level

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


@pytest.fixture(autouse=True)
def _restore_loggers():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
             for name in LOGGERS}  # fmt: skip
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


def _lines(rank: int, world: int, level: int | None) -> list[str]:
    stream = io.StringIO()
    configure_logging(level, rank, world, stream)
    logging.getLogger("mp_train").info("an info line")
    logging.getLogger("mp_ckpt").warning("a warning")
    logging.getLogger("mp_data").debug("a debug line")
    return stream.getvalue().splitlines()


def test_rank_zero_and_the_last_rank_show_the_level_others_warnings():
    first = _lines(0, 4, None)
    assert [line.split(" ", 2)[2] for line in first] == [
        "[rank 0] INFO mp_train: an info line",
        "[rank 0] WARNING mp_ckpt: a warning",
    ]
    assert len(_lines(3, 4, None)) == 2
    assert [line.split(" ", 2)[2] for line in _lines(1, 4, None)] == [
        "[rank 1] WARNING mp_ckpt: a warning"
    ]
    assert len(_lines(0, 1, logging.DEBUG)) == 3
    assert len(_lines(0, 1, logging.WARNING)) == 1


def test_configuring_again_replaces_the_handler():
    _lines(0, 1, None)
    _lines(0, 1, None)
    handlers = logging.getLogger("mp_train").handlers
    assert sum(type(h).__name__ == "_RunHandler" for h in handlers) == 1


def test_the_level_flag_takes_numbers_and_names():
    assert parse_level("20") == parse_level("info") == parse_level("INFO") == logging.INFO
    assert parse_config([*MODEL, "--logging-level", "debug"]).logging.logging_level == 10
    assert parse_config([*MODEL, "--logging-level", "30"]).logging.logging_level == 30
    assert parse_config(MODEL).logging.logging_level is None
    with pytest.raises(argparse.ArgumentTypeError, match="'loud' is not a logging level"):
        parse_level("loud")
