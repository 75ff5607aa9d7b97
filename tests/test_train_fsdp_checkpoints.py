"""Checkpoints under fully sharded data parallelism load under every other layout, and the
reverse, optimizer state included (apps/gpt's tiny config, fp32, 4 iterations, saved at
iteration 2).

A checkpoint saved under ZeRO-3 at DP4 (written in the background, `--ckpt-format
fsdp_dtensor`, just after an evaluation; the uninterrupted run's save of iteration 2)
resumes at TP2 x DP2 with DDP and at DP2 with the distributed optimizer; checkpoints
saved at those two layouts resume under ZeRO-3 and ZeRO-2 at DP4. Iterations 3 and 4 of
every resumed run have the losses and gradient norms of the ZeRO-3 run that never stopped
(1e-5 relative; the layouts' own curves agree that closely, see test_train_fsdp.py). In
bf16, where each rank's shards are the fp32 main parameters and the checkpoint keeps the
model's bf16 weights beside them: a ZeRO-3 run resumed at its own layout continues the
uninterrupted curve exactly, and the same checkpoint resumes at DP2 with the distributed
optimizer (its fp32 main parameters loaded). A ZeRO-3 checkpoint of DP2 x PP2 x VPP2 (two
FSDP2 roots per rank) resumes at its own layout and under DDP at TP2 x DP2."""

import shutil
from pathlib import Path

import pytest

from mp_ckpt.core.layout import TRACKER
from mp_gpt.testing import assert_same_curve, metrics_records, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LOGGED = ("lm loss", "grad_norm")
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
TP2_DDP = ["--tensor-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]


def train(run_dir: Path, ranks: int, checkpoint: Path, *extra: str) -> list[dict]:
    """Trains (resuming from `checkpoint` if it holds one, saving there every 2 iterations)
    and returns the run's metrics records."""
    saves = ["--save", str(checkpoint), "--load", str(checkpoint), "--save-interval", "2"]
    argv = tiny_options(run_dir, *saves, *extra)
    run_on_ranks(train_on_rank, ranks, argv, timeout=300)
    return metrics_records(run_dir)


def resumed(tmp_path: Path, name: str, saved: Path, ranks: int, *extra: str) -> list[dict]:
    """Iterations 3 and 4 of a run resumed from a copy of the save of iteration 2 under
    `saved`."""
    checkpoint = tmp_path / name / "ckpt"
    shutil.copytree(saved / "iter_0000002", checkpoint / "iter_0000002")
    (checkpoint / TRACKER).write_text("2")
    records = train(tmp_path / name, ranks, checkpoint, *extra)
    assert [r["iteration"] for r in records] == [3, 4], name
    return records


def test_zero3_checkpoints_load_under_ddp_and_the_distributed_optimizer_and_back(tmp_path):
    # The run that never stops saves at iterations 2 and 4: its save of iteration 2 is
    # ZeRO-3's checkpoint to resume from elsewhere. It evaluates just before each save,
    # which once left the root's parameters gathered and its optimizer state unsaved.
    zero3 = [*ZERO3, "--async-save", "--ckpt-format", "fsdp_dtensor", "--eval-interval", "2",
             "--eval-iters", "1"]  # fmt: skip
    whole = train(tmp_path / "zero3", 4, tmp_path / "zero3" / "ckpt", *zero3)
    want = whole[2:]
    stop = ["--exit-interval", "2"]
    saved = {"tp2-ddp": (4, TP2_DDP), "dp2-distopt": (2, DISTOPT)}
    for name, (ranks, flags) in saved.items():
        first = train(tmp_path / name, ranks, tmp_path / name / "ckpt", *flags, *stop)
        assert [r["iteration"] for r in first] == [1, 2], name
        assert_same_curve(first, whole[:2], LOGGED, f"{name} before saving")
    loads = {
        "zero3 -> tp2-ddp": ("zero3", 4, TP2_DDP),
        "zero3 -> dp2-distopt": ("zero3", 2, DISTOPT),
        "tp2-ddp -> zero3": ("tp2-ddp", 4, ZERO3),
        "dp2-distopt -> zero2": ("dp2-distopt", 4, ZERO2),
    }
    for name, (source, ranks, flags) in loads.items():
        got = resumed(tmp_path, name.replace(" -> ", "-to-"), tmp_path / source / "ckpt",
                      ranks, *flags)  # fmt: skip
        assert_same_curve(got, want, LOGGED, name)


def test_a_bf16_zero3_checkpoint_keeps_the_fp32_main_parameters(tmp_path):
    bf16 = ["--bf16"]
    whole = train(tmp_path / "whole", 2, tmp_path / "whole" / "ckpt", *bf16, *ZERO3)
    again = resumed(tmp_path, "again", tmp_path / "whole" / "ckpt", 2, *bf16, *ZERO3)
    values = [[r[k] for k in LOGGED] for r in again]
    assert values == [[r[k] for k in LOGGED] for r in whole[2:]]
    # Another engine from the same checkpoint: its curve within bf16's rounding of ZeRO-3's.
    other = resumed(tmp_path, "distopt", tmp_path / "whole" / "ckpt", 2, *bf16, *DISTOPT)
    for mine, reference in zip(other, whole[2:], strict=True):
        assert mine["lm loss"] == pytest.approx(reference["lm loss"], rel=2e-3), mine


VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "8"]  # fmt: skip


def test_a_zero3_checkpoint_of_virtual_stages_loads_under_ddp_and_at_its_own_layout(tmp_path):
    """DP2 x PP2 x VPP2 under ZeRO-3: each rank's two chunks, each its own FSDP2 root,
    saved at iteration 2 and resumed on the uninterrupted curve at the same layout and
    under DDP at TP2 x DP2."""
    whole = train(tmp_path / "zero3", 4, tmp_path / "zero3" / "ckpt", *ZERO3, *VPP2)
    saved = tmp_path / "zero3" / "ckpt"
    for name, flags in (("again", [*ZERO3, *VPP2]), ("tp2-ddp", [*TP2_DDP, *VPP2[-2:]])):
        got = resumed(tmp_path, name, saved, 4, *flags)
        assert_same_curve(got, whole[2:], LOGGED, name)
