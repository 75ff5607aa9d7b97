"""Async saves in the training loop: the same run as with synchronous saves.

Two ranks (forked, gloo), the tiny config with mock data, 6 iterations saving
every 3, once with synchronous saves and once with `--async-save` (whose
staging buffers are prepared at start, which creates the optimizer's states
before the first step). The loss curves are bitwise equal, and so are the
two checkpoints of iteration 6, tensor by tensor.
"""

import json
from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, read_tracker
from mp_gpt.testing import GIVEN_PEAK, TINY_CONFIG, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def options(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--save-interval", "3",
        "--eval-interval", "none", "--log-interval", "100", "--num-workers", "0",
        "--tensorboard-dir", "none", "--lr-warmup-iters", "2",
        "--save", str(run_dir / "ckpt"), "--load", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), *extra,
    ]  # fmt: skip


def test_async_saves_train_and_save_like_synchronous_ones(tmp_path):
    losses = {}
    for kind, extra in (("sync", ()), ("async", ("--async-save",))):
        run_dir = tmp_path / kind
        run_on_ranks(train_on_rank, 2, options(run_dir, *extra), timeout=300)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        losses[kind] = [json.loads(line)["lm loss"] for line in lines]
        assert read_tracker(run_dir / "ckpt") == 6, kind
    assert len(losses["sync"]) == 6 and losses["async"] == losses["sync"]
    sync, asynchronous = CheckpointReader(tmp_path / "sync" / "ckpt"), CheckpointReader(
        tmp_path / "async" / "ckpt")  # fmt: skip
    assert sync.keys == asynchronous.keys and any(k.startswith("optimizer.") for k in sync.keys)
    for key in sync.keys:
        assert torch.equal(sync.read(key), asynchronous.read(key)), key
