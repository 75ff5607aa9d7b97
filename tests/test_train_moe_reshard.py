"""A MoE checkpoint saved at EP2 resumes at EP1, and one saved at EP1 resumes at EP2,
optimizer state included: the iterations after the resume give the losses, auxiliary
losses and gradient norms of the run that never stopped (apps/gpt's tiny-moe config,
fp32; with the plain and the distributed optimizer)."""

from pathlib import Path

import pytest

from mp_gpt.testing import (
    LOGGED_MOE,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

EP = {1: ["--expert-model-parallel-size", "1"], 2: ["--expert-model-parallel-size", "2"]}


def run(run_dir: Path, ranks: int, optimizer: list[str], save: Path, *extra: str) -> None:
    checkpoints = ["--save", str(save), "--load", str(save), "--save-interval", "2"]
    argv = tiny_moe_options(run_dir, *EP[ranks], *optimizer, *checkpoints, *extra)
    run_on_ranks(train_on_rank, ranks, argv, timeout=300)


@pytest.mark.parametrize(
    "optimizer", [[], ["--use-distributed-optimizer"]], ids=["adam", "distopt"]
)
@pytest.mark.parametrize(
    ("saved_at", "resumed_at"), [(2, 1), (1, 2)], ids=["ep2-to-ep1", "ep1-to-ep2"]
)
def test_a_moe_checkpoint_resumes_at_another_expert_parallel_size(
    tmp_path, optimizer, saved_at, resumed_at
):
    whole = tmp_path / "whole"
    run(whole, saved_at, optimizer, whole / "ckpt")
    want = metrics_records(whole)
    cut = tmp_path / "cut"
    run(cut, saved_at, optimizer, cut / "ckpt", "--exit-interval", "2")
    run(cut, resumed_at, optimizer, cut / "ckpt")
    got = metrics_records(cut)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    assert_same_curve(got[2:], want[2:], LOGGED_MOE, f"EP{saved_at} -> EP{resumed_at}")
