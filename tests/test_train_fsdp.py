"""Fully sharded data parallelism end to end: apps/gpt's tiny config (fp32, dropout 0) for
6 iterations under ZeRO-2 and ZeRO-3 (--use-megatron-fsdp with optim_grads and
optim_grads_params) has the DDP run's losses and gradient norms (1e-5 relative) at DP4,
DP2 x TP2 with sequence parallelism, DP2 x CP2, DP2 x PP2 (1F1B), DP2 x PP2 x VPP2
(interleaved) and, on the tiny MoE config, EP2 with four data-parallel ranks (experts
sharded over expert dp 2) and EP4 (each expert on one rank, its expert dp group of one).
Each layout's three runs share its settings, which also take in what FSDP composes with:
random initialization per data-parallel rank (TP2), per-token loss normalization (CP2),
a multi-token prediction layer on the last stage, its loss compared too, and an
evaluation every 5 iterations (PP2), averaging in the collective (EP2); and at DP4, DP2
x PP2 and EP2 the overlap flags (ZeRO-3: on the CPU asynchronous all-gathers) and at DP4
full recompute (ZeRO-2) on the FSDP side only, as they change no value, and at DP2 x PP2
and EP2 ZeRO-3 builds its chunks layer by layer (--init-model-with-meta-device: the same
weights). ZeRO-2 and ZeRO-3
differ only in when parameters are gathered, so their curves are equal exactly.
Then a few iterations in bf16 (ZeRO-3, gradients reduced in fp32) and in fp16 (ZeRO-2,
dynamic loss scaling) train with finite, decreasing losses, and FP8 GEMMs (emulated) at
DP2 under ZeRO-3 follow DDP's. On a GPU, one rank in bf16, and with FP8, under ZeRO-2
and ZeRO-3 has the DDP run's curve."""

import math
import os

import pytest
import torch

from mp_gpt.testing import (
    LOGGED_MOE,
    assert_same_curve,
    metrics_records,
    tiny_moe_options,
    tiny_options,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 6
QUICK = ["--train-iters", str(ITERATIONS)]
LOGGED = ("lm loss", "grad_norm")
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
EVALUATE = ["--eval-interval", "5", "--eval-iters", "1"]  # a forward-only pass between steps
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--data-parallel-random-init"]
CP2 = ["--context-parallel-size", "2", "--calculate-per-token-loss"]
PP2 = ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1", *EVALUATE]
EP2 = ["--expert-model-parallel-size", "2", "--average-in-collective"]
# interleaved 1F1B, a layer per chunk, 4 micro-batches per rank: each chunk's last
# backward, not the step's last, reduces its gradients
VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--global-batch-size", "8"]  # fmt: skip
BY_LAYER = ["--init-model-with-meta-device"]  # each layer sharded as soon as it is built

# name -> (tiny MoE config, settings of all three runs, ZeRO-3's extra, ZeRO-2's extra)
LAYOUTS = {
    "dp4": (False, [], OVERLAP, [*RECOMPUTE, "--recompute-num-layers", "1"]),
    "dp2-tp2-sp": (False, TP2, [], []),
    "dp2-cp2": (False, CP2, [], []),
    "dp2-pp2": (False, PP2, [*BY_LAYER, *OVERLAP], []),
    "dp2-pp2-vpp2": (False, VPP2, [], []),
    "dp4-ep2": (True, EP2, [*BY_LAYER, *OVERLAP], []),
    # every expert on one rank: each expert module is "sharded" over a group of one
    "dp4-ep4": (True, ["--expert-model-parallel-size", "4"], [], []),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero2_and_zero3_train_as_ddp(tmp_path, name):
    moe, common, zero3, zero2 = LAYOUTS[name]
    options, keys = (tiny_moe_options, LOGGED_MOE) if moe else (tiny_options, LOGGED)
    if "--mtp-num-layers" in common:
        keys = (*keys, "mtp_1 loss")
    curves = {}
    for run, extra in (("ddp", []), ("zero3", [*ZERO3, *zero3]), ("zero2", [*ZERO2, *zero2])):
        argv = options(tmp_path / run, *QUICK, *common, *extra)
        run_on_ranks(train_on_rank, 4, argv, timeout=300)
        curves[run] = metrics_records(tmp_path / run)
    assert len(curves["ddp"]) == ITERATIONS
    assert_same_curve(curves["zero3"], curves["ddp"], keys, f"{name} zero3")
    assert_same_curve(curves["zero2"], curves["ddp"], keys, f"{name} zero2")
    assert [r[k] for r in curves["zero2"] for k in keys] == [
        r[k] for r in curves["zero3"] for k in keys
    ]


HALF = {
    "bf16-zero3": ["--bf16", *ZERO3, *BY_LAYER],
    # From 2^32 every step of the first 30 would overflow and be skipped, under DDP too.
    "fp16-zero2": ["--fp16", "--initial-loss-scale", "4096", *ZERO2],
}


@pytest.mark.parametrize("name", list(HALF))
def test_half_precision_trains(tmp_path, name):
    """...and in bf16 (ZeRO-3 built layer by layer) a second run in the same processes (as
    a notebook would start one) repeats the first: FSDP's meshes over the new groups, and
    each sharded parameter on its own run's mesh (DTensor's caches compare meshes by
    ranks and dimension names, not by process group)."""
    argv = tiny_options(tmp_path, "--train-iters", "6", *HALF[name])
    runs = 2 if name == "bf16-zero3" else 1
    run_on_ranks(train_runs_on_rank, 2, argv, runs, timeout=300)
    losses = [r["lm loss"] for r in metrics_records(tmp_path)]
    assert len(losses) == 6 * runs and all(math.isfinite(x) for x in losses)
    assert losses[5] < losses[0] - 0.05, losses
    assert losses[6:] in ([], losses[:6]), losses


FP8_ITERATIONS = 3


def test_fp8_under_zero3_trains_as_ddp(tmp_path):
    """FP8 GEMMs (torchao's numerics, emulated on the CPU: --fp8-emulate) at DP2 under
    ZeRO-3 take the gathered bf16 weights as DDP's take its bf16 copies: the first
    iteration's loss is DDP's exactly (its gradient norm within fp32 reduction order), the
    next ones within 1e-4 relative (1.2e-5 measured), gradient norms within 1e-2 (4.2e-3:
    FSDP2 and DDP accumulate and round the bf16 gradients in another order, and FP8's
    per-tensor scales pass those differences on)."""
    fp8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-emulate",
           "--train-iters", str(FP8_ITERATIONS)]  # fmt: skip
    layers = {}
    for run, sharding in (("ddp", []), ("zero3", ZERO3)):
        argv = tiny_options(tmp_path / run, *fp8, *sharding)
        layers[run] = run_on_ranks(fp8_layers_on_rank, 2, argv, timeout=300)
    assert layers["zero3"] == layers["ddp"] == [16, 16]  # QKV, proj, fc1, fc2 of 4 layers
    ddp, zero3 = (metrics_records(tmp_path / run) for run in ("ddp", "zero3"))
    assert len(ddp) == len(zero3) == FP8_ITERATIONS
    assert zero3[0]["lm loss"] == ddp[0]["lm loss"]
    assert zero3[0]["grad_norm"] == pytest.approx(ddp[0]["grad_norm"], rel=1e-6)
    for got, want in zip(zero3, ddp, strict=True):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-4), (got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-2), (got, want)


def fp8_layers_on_rank(argv: list[str]) -> int:
    """Trains; the transformer block's linear layers that computed in FP8."""
    from mp_gpt.testing import train_run_on_rank

    return train_run_on_rank(argv).model[0].module.decoder.fp8_linear_layers


def train_runs_on_rank(argv: list[str], runs: int) -> None:
    """`runs` trainings one after the other in this process (the default group stays),
    mp's groups rebuilt between."""
    import mp_state
    from mp_gpt.pretrain import train
    from mp_train import load_config

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")  # tiny.yaml's paths, unused
    for run in range(runs):
        if run:
            mp_state.destroy()
        train(load_config(argv))


def params_norm_on_rank(argv: list[str]) -> float:
    from mp_gpt.testing import train_run_on_rank
    from mp_train.observability.metrics import parameters_norm

    return parameters_norm(train_run_on_rank(argv))


def test_params_norm_over_shards_is_ddps(tmp_path):
    """--log-params-norm under ZeRO-3 at DP2 x TP2: the norm of every rank's rows of the
    fp32 parameters, each element once, equals DDP's norm of the whole parameters after
    the same 3 steps (and the run, which logs it every iteration, is not refused)."""
    norms = {}
    for name, extra in (("ddp", []), ("zero3", ZERO3)):
        argv = tiny_options(tmp_path / name, "--train-iters", "3", "--log-params-norm",
                            "--log-interval", "1", *TP2, *extra)  # fmt: skip
        norms[name] = run_on_ranks(params_norm_on_rank, 4, argv, timeout=300)
    assert len(set(norms["zero3"])) == 1  # every rank reports the same norm
    assert norms["zero3"][0] == pytest.approx(norms["ddp"][0], rel=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_zero2_and_zero3_train_as_ddp_on_cuda(tmp_path, precision):
    """One rank on the GPU (NCCL, FSDP2's own streams), bf16, and with FP8 GEMMs (needs
    torchao and FP8 tensor cores): the DDP run's curve."""
    flags = ["--bf16"]
    if precision == "fp8":
        pytest.importorskip("torchao", reason="FP8 needs torchao")
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("FP8 needs FP8 tensor cores (compute capability 8.9+)")
        flags += ["--fp8-format", "hybrid"]
    curves = {}
    for run, sharding in (("ddp", []), ("zero3", ZERO3), ("zero2", ZERO2)):
        argv = tiny_options(tmp_path / run, *QUICK, *flags, *sharding)
        run_on_ranks(train_on_rank, 1, argv, device="cuda", timeout=300)
        curves[run] = metrics_records(tmp_path / run)
    assert len(curves["ddp"]) == ITERATIONS
    for run in ("zero3", "zero2"):
        assert_same_curve(curves[run], curves["ddp"], LOGGED, f"cuda {run}")
