"""RNG states in training checkpoints: each rank takes back its own, no_load_rng and
no_save_rng leave them out, and a resume under another layout keeps its seeding with a
warning. (That a killed run then continues bitwise, dropout on, is in
test_train_resume.py.)"""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK
from mp_state.testing import run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"


def options(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "none",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"),
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--tensorboard-dir", "none",
        "--num-workers", "0", "--lr-warmup-iters", "0", "--log-interval", "100", *extra,
    ]  # fmt: skip


def _warnings() -> list[str]:
    """Collects what mp_train warns about the RNG states, from now on, in this process
    (not, say, that a first run's --load holds no checkpoint yet)."""
    import logging

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "RNG" in record.getMessage():
                seen.append(record.getMessage())

    logging.getLogger("mp_train").addHandler(Collect(logging.WARNING))
    return seen


def _train(argv):
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import train
    from mp_train import parse_config

    return train(parse_config(argv))


def _same(a, b) -> bool:
    """Whether two of mp_state.get_rng_state's captures are equal, generator by generator."""
    import numpy as np
    import torch

    numpy_same = a["numpy"][0] == b["numpy"][0] and np.array_equal(a["numpy"][1], b["numpy"][1])
    return (
        a["random"] == b["random"]
        and numpy_same
        and torch.equal(a["torch"], b["torch"])
        and sorted(a["tracker"]) == sorted(b["tracker"])
        and all(torch.equal(a["tracker"][k], b["tracker"][k]) for k in a["tracker"])
    )


def _draw_from_everything(tracker, rank: int) -> None:
    """Moves every generator on, differently on each rank."""
    import random

    import numpy as np
    import torch

    for _ in range(rank + 1):
        random.random(), np.random.rand(), torch.rand(3)
        for name in tracker.names:
            with tracker.fork(name):
                torch.rand(3)


def restore_body(argv, other_dir):
    import dataclasses

    import torch.distributed as dist

    import mp_state
    from mp_ckpt import Checkpointer
    from mp_train.loop.checkpointing import load_run_checkpoint, save_run_checkpoint

    warned = _warnings()
    run = _train(argv)  # saves at its end, after iteration 2
    tracker, rank = run.rng_tracker, dist.get_rank()
    saved = mp_state.get_rng_state(tracker)
    out = {"tp_stream": saved["tracker"][mp_state.TENSOR_PARALLEL_RNG]}

    _draw_from_everything(tracker, rank)
    load_run_checkpoint(run)
    out["restored"] = _same(mp_state.get_rng_state(tracker), saved)

    checkpoint = run.config.checkpoint
    _draw_from_everything(tracker, rank)
    moved = mp_state.get_rng_state(tracker)
    run.config.checkpoint = dataclasses.replace(checkpoint, no_load_rng=True)
    load_run_checkpoint(run)
    out["no_load_rng_kept_them"] = _same(mp_state.get_rng_state(tracker), moved)

    run.config.checkpoint = dataclasses.replace(checkpoint, no_save_rng=True, load=other_dir)
    checkpointer = Checkpointer(other_dir)
    save_run_checkpoint(run, checkpointer)
    checkpointer.finalize()
    run.config.checkpoint = dataclasses.replace(checkpoint, load=other_dir)
    load_run_checkpoint(run)
    out["unsaved_kept_them"] = _same(mp_state.get_rng_state(tracker), moved)
    out["warnings"] = warned
    return out


@pytest.mark.multirank
def test_each_rank_takes_back_its_own_streams_unless_told_not_to(tmp_path):
    argv = options(tmp_path, "--tensor-model-parallel-size", "2")
    other = tmp_path / "without_rng"
    results = run_on_ranks(restore_body, 2, argv, str(other), timeout=120)
    import torch

    # The tensor-parallel stream differs between the two ranks: each took back its own.
    assert not torch.equal(results[0]["tp_stream"], results[1]["tp_stream"])
    for rank, out in enumerate(results):
        assert out["restored"], rank
        assert out["no_load_rng_kept_them"], rank
        assert out["unsaved_kept_them"], rank
    assert sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000002").glob("rank_*.pt")) == [
        "rank_00000.pt", "rank_00001.pt",
    ]  # fmt: skip
    assert not list((other / "iter_0000002").glob("rank_*.pt"))
    # no_load_rng is asked for, so silent; a checkpoint without RNG states is warned about.
    assert results[1]["warnings"] == []
    (warning,) = results[0]["warnings"]
    assert "RNG states not restored" in warning and "no_save_rng" in warning, warning


def layout_body(argv):
    warned = _warnings()
    run = _train(argv)
    return run.train.iteration, warned


@pytest.mark.multirank
def test_a_resume_under_another_layout_keeps_its_seeding_with_a_warning(tmp_path):
    import json
    import math

    dp2 = options(tmp_path, "--train-iters", "4", "--exit-interval", "2")
    assert run_on_ranks(layout_body, 2, dp2, timeout=120) == [(2, []), (2, [])]
    tp2 = options(tmp_path, "--train-iters", "4", "--tensor-model-parallel-size", "2")
    (first, warned), (second, quiet) = run_on_ranks(layout_body, 2, tp2, timeout=120)
    assert first == second == 4 and quiet == []
    (warning,) = warned
    assert "RNG states not restored: saved under another layout" in warning, warning
    assert "tensor_model_parallel_size: checkpoint 1, this run 2" in warning
    assert "data_parallel_size: checkpoint 2, this run 1" in warning
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    losses = {r["iteration"]: r["lm loss"] for r in map(json.loads, lines)}
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())


@pytest.mark.multirank
def test_another_rank_order_keeps_its_seeding_with_a_warning(tmp_path):
    # TP2 x DP2 saved with tp varying fastest (rank 1 is tp 1, dp 0), resumed with dp
    # varying fastest (rank 1 is tp 0, dp 1): the same sizes, so only the positions tell.
    first = options(tmp_path, "--train-iters", "4", "--exit-interval", "2",
                    "--tensor-model-parallel-size", "2")  # fmt: skip
    assert [out[1] for out in run_on_ranks(layout_body, 4, first, timeout=120)] == [[]] * 4
    swapped = options(tmp_path, "--train-iters", "4", "--tensor-model-parallel-size", "2",
                      "--order", "ep-dp-tp-cp-pp")  # fmt: skip
    results = run_on_ranks(layout_body, 4, swapped, timeout=120)
    assert [out[0] for out in results] == [4] * 4
    assert [out[1] for out in results[1:]] == [[]] * 3
    (warning,) = results[0][1]
    assert "RNG states not restored: saved with the ranks placed otherwise" in warning, warning
