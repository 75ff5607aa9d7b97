"""Megatron's precision-aware optimizer through the real loop (--use-precision-aware-optimizer
--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 at DP2, with the distributed optimizer and
under ZeRO-3): Adam's moments are held in bf16 (half the state's bytes), the curve stays
within rounding of the fp32 moments' one, and the checkpoint's moments load as bf16 into
the same run (which goes on exactly as the uninterrupted run, the compiled update too)
and as fp32 into a run without the flag."""

import pytest
import torch

from mp_gpt.testing import metrics_records, tiny_options, train_run_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

DP2 = ["--use-distributed-optimizer", "--train-iters", "6"]
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                "--exp-avg-sq-dtype", "bf16"]  # fmt: skip


def moments_on_rank(argv: list[str]) -> tuple[set, int]:
    """(the dtypes of Adam's moments, their bytes on this rank) after the run."""
    optimizer = train_run_on_rank(argv).optimizer.optimizer
    moments = [t for state in optimizer.state.values() for name, t in state.items()
               if name in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    return {t.dtype for t in moments}, sum(t.numel() * t.element_size() for t in moments)


@pytest.mark.parametrize("sharding", ["distopt", "zero3"])
def test_bf16_moments_halve_the_state_and_keep_the_curve(tmp_path, sharding):
    layout = DP2 if sharding == "distopt" else [*ZERO3, "--train-iters", "6"]
    runs = {}
    for name, extra in (("fp32", []), ("bf16", BF16_MOMENTS)):
        options = tiny_options(tmp_path / name, *layout, *extra)
        runs[name] = run_on_ranks(moments_on_rank, 2, options)
    (dtypes32, bytes32), _ = runs["fp32"]
    (dtypes16, bytes16), _ = runs["bf16"]
    assert dtypes32 == {torch.float32} and dtypes16 == {torch.bfloat16}
    assert bytes16 * 2 == bytes32
    want, got = metrics_records(tmp_path / "fp32"), metrics_records(tmp_path / "bf16")
    assert got[0]["lm loss"] == want[0]["lm loss"]  # the first step's loss precedes any update
    for a, b in zip(got, want, strict=True):
        assert abs(a["lm loss"] - b["lm loss"]) < 2e-3 * b["lm loss"], (a, b)
    assert got[-1]["lm loss"] < got[0]["lm loss"] - 0.1  # it learns


@pytest.mark.parametrize("compiled", [False, True], ids=["fused", "compiled"])
def test_bf16_moments_resume_exactly_and_load_as_fp32(tmp_path, compiled):
    extra = [*DP2, *BF16_MOMENTS, *(["--torch-compile-optimizer"] if compiled else [])]
    run_on_ranks(moments_on_rank, 2, tiny_options(tmp_path / "whole", *extra))
    ckpt = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--save-interval", "3"]
    halves = tmp_path / "halves"
    run_on_ranks(moments_on_rank, 2, tiny_options(halves, *extra, *ckpt, "--exit-interval", "3"))
    (dtypes, _), _ = run_on_ranks(moments_on_rank, 2, tiny_options(halves, *extra, *ckpt))
    assert dtypes == {torch.bfloat16}
    whole, resumed = metrics_records(tmp_path / "whole"), metrics_records(halves)
    assert [r["lm loss"] for r in resumed] == [r["lm loss"] for r in whole]
    if compiled:
        return
    plain = tmp_path / "plain"  # the checkpoint of iteration 6 into fp32 moments
    more = tiny_options(
        plain,
        *DP2,
        "--load",
        str(tmp_path / "ck"),
        "--train-iters",
        "8",
        "--use-checkpoint-opt-param-scheduler",
    )
    (dtypes, _), _ = run_on_ranks(moments_on_rank, 2, more)
    assert dtypes == {torch.float32}
    assert [r["iteration"] for r in metrics_records(plain)] == [7, 8]
