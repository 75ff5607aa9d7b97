"""Context parallelism end to end: apps/gpt's tiny config (GQA, RoPE, fp32, dropout 0) at
sequence 256 trains with the one-rank loss curve, gradient norms and consumed samples at
CP2 (every comm type), CP4 hierarchically (a2a+p2p, 2 x 2) and CP2 as 2 x 1, CP2 x TP2
with sequence parallelism, CP2 x PP2 (also with virtual
stages) and CP2 x DP2 (also with the distributed optimizer); with attention dropout over
the ring, the all-to-all and the two together, recomputed alike."""

from pathlib import Path

import pytest

from mp_gpt.testing import (
    GIVEN_PEAK,
    TINY_CONFIG,
    assert_same_curve,
    metrics_records,
    train_on_rank,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 4


def options(run_dir: Path, *layout: str) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512",
        "--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--eval-interval", "none", "--log-interval", "10",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), "--num-workers", "0",
        "--lr-warmup-iters", "1", *layout,
    ]  # fmt: skip


CP2 = ["--context-parallel-size", "2"]
LAYOUTS = {
    "cp2-p2p": (2, [*CP2, "--cp-comm-type", "p2p"]),
    "cp2-all_gather": (2, [*CP2, "--cp-comm-type", "all_gather"]),
    "cp2-a2a": (2, [*CP2, "--cp-comm-type", "a2a"]),
    "cp2-tp2-sp": (4, [*CP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "cp2-pp2": (4, [*CP2, "--pipeline-model-parallel-size", "2"]),
    "cp2-pp2-vpp2": (
        4,
        [
            *CP2,
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
    ),
    "cp4-a2a+p2p": (
        4,
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ],
    ),
    "cp2-a2a+p2p-2x1": (
        2,
        [*CP2, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1"],
    ),
    "cp2-dp2": (4, CP2),
    "cp2-dp2-distopt": (4, [*CP2, "--use-distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-rank")
    run_on_ranks(train_on_rank, 1, options(run_dir), timeout=300)
    return metrics_records(run_dir)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_trains_as_one_rank(tmp_path, reference, name):
    world, layout = LAYOUTS[name]
    run_on_ranks(train_on_rank, world, options(tmp_path, *layout), timeout=300)
    assert len(reference) == ITERATIONS
    assert_same_curve(metrics_records(tmp_path), reference, ("lm loss", "grad_norm"), name)


DROPOUT_LAYOUTS = {
    "p2p": ["--cp-comm-type", "p2p"],
    "a2a": ["--cp-comm-type", "a2a"],
    # the ring over an outer group of 2, each rank's heads its own masks
    "a2a+p2p-1x2": ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "1",
                    "2"],
}  # fmt: skip


@pytest.mark.parametrize("comm_type", list(DROPOUT_LAYOUTS))
def test_attention_dropout_trains_and_recomputes_the_same_masks(tmp_path, reference, comm_type):
    """Attention dropout 0.1 (Megatron-LM's default) at CP2: the run trains off the
    dropout-free curve, and with core attention recomputed in backward (selective
    recompute) it has the same losses and gradient norms exactly: the recomputed forward
    draws the same masks (p2p: from the same seed; a2a: the one-rank kernel's, from the
    restored tensor-parallel stream)."""
    dropout = [*CP2, *DROPOUT_LAYOUTS[comm_type], "--attention-dropout", "0.1"]
    curves = {}
    for name, extra in (("plain", []), ("recompute", ["--recompute-granularity", "selective"])):
        run_on_ranks(train_on_rank, 2, options(tmp_path / name, *dropout, *extra), timeout=300)
        curves[name] = metrics_records(tmp_path / name)
    keys = ("lm loss", "grad_norm")
    assert [[r[k] for k in keys] for r in curves["recompute"]] == [
        [r[k] for k in keys] for r in curves["plain"]
    ]
    losses = [r["lm loss"] for r in curves["plain"]]
    assert losses != [r["lm loss"] for r in reference]  # the masks act
    assert losses[-1] < losses[0], losses
