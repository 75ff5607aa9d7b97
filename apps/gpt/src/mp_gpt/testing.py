"""Helpers for tests that train apps/gpt end to end on forked gloo ranks."""

from __future__ import annotations

import os

import torch

from mp_gpt.config_files import config_path

__all__ = ["TINY_CONFIG", "train_on_rank", "train_run_on_rank"]

TINY_CONFIG = config_path("tiny.yaml")


def train_on_rank(argv: list[str]) -> int:
    """One rank of a run of `mp_gpt.pretrain.main(argv)` under mp_state.testing's launcher:
    one thread per rank (the forked ranks share the cores) and no run directory."""
    _rank_setup()
    from mp_gpt.pretrain import main

    return main(argv)


def train_run_on_rank(argv: list[str]):
    """As train_on_rank, but returns the finished run (mp_train's Run) for the test to
    read from; the process group stays up, as the launcher ends the rank anyway."""
    _rank_setup()
    from mp_gpt.pretrain import train
    from mp_train import parse_config

    return train(parse_config(argv))


def _rank_setup() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
