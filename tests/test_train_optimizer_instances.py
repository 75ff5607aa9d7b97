"""The distributed optimizer in two instances (Megatron's --num-distributed-optimizer-instances
2) end to end: apps/gpt's tiny-moe config at EP2 x DP4 on 4 ranks (fp32, 4 iterations,
saved at iteration 2). The dense parameters shard over pairs of data-parallel ranks and
the expert parameters over a single rank (their data-parallel group of 2 cut in two), the
gradients summed across the instances; the run has the losses, auxiliary losses and
gradient norms of one instance. Each run's save of iteration 2 resumes under the other:
iterations 3 and 4 as the run that never stopped (the optimizer state, saved once from
the first instance, loads into one instance and into two). Under ZeRO-3
(--use-megatron-fsdp) two instances shard hybridly (FSDP2's HSDP: each layer over a
pair, replicated across the pairs) with the same curve, and its save resumes under the
distributed optimizer in one instance."""

import shutil
from pathlib import Path

import pytest

from mp_ckpt.core.layout import TRACKER
from mp_gpt.testing import (
    LOGGED_MOE,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LAYOUT = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
TWO = ["--num-distributed-optimizer-instances", "2"]
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def train(run_dir: Path, checkpoint: Path, *extra: str) -> list[dict]:
    """Trains on 4 ranks (resuming from `checkpoint` if it holds a save, saving there every
    2 iterations); the run's metrics records."""
    saves = ["--save", str(checkpoint), "--load", str(checkpoint), "--save-interval", "2"]
    run_on_ranks(train_on_rank, 4, tiny_moe_options(run_dir, *LAYOUT, *saves, *extra),
                 timeout=300)  # fmt: skip
    return metrics_records(run_dir)


def test_two_instances_train_and_resume_as_one(tmp_path):
    layouts = (("one", []), ("two", TWO), ("zero3-two", [*ZERO3, *TWO]))
    runs = {name: train(tmp_path / name, tmp_path / name / "ckpt", *flags)
            for name, flags in layouts}  # fmt: skip
    assert [r["iteration"] for r in runs["one"]] == [1, 2, 3, 4]
    assert_same_curve(runs["two"], runs["one"], LOGGED_MOE, "two instances")
    assert_same_curve(runs["zero3-two"], runs["one"], LOGGED_MOE, "two instances of ZeRO-3")
    for source, flags in (("one", TWO), ("two", []), ("zero3-two", [])):
        name = f"{source}-resumed"
        checkpoint = tmp_path / name / "ckpt"
        shutil.copytree(tmp_path / source / "ckpt" / "iter_0000002", checkpoint / "iter_0000002")
        (checkpoint / TRACKER).write_text("2")
        got = train(tmp_path / name, checkpoint, *flags)
        assert_same_curve(got, runs[source][2:], LOGGED_MOE, name)
