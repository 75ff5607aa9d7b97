"""Helpers for tests that train apps/gpt end to end on forked gloo ranks."""

from __future__ import annotations

import os

import torch

from mp_gpt.config_files import config_path

__all__ = ["TINY_CONFIG", "train_on_rank"]

TINY_CONFIG = config_path("tiny.yaml")


def train_on_rank(argv: list[str]) -> int:
    """One rank of a run of `mp_gpt.pretrain.main(argv)` under mp_state.testing's launcher:
    one thread per rank (the forked ranks share the cores) and no run directory."""
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import main

    return main(argv)
