"""The tiny Qwen3-Next (apps/gpt/configs/tiny-qwen3-next.yaml: three gated DeltaNet layers,
then gated softmax attention with qk-layernorm; MoE layers with a gated shared expert;
zero-centred norms) trains through pretrain_gpt to the one-rank curve at TP2 with sequence
parallelism (which experts at TP need; the DeltaNet's output norm is shared by heads split
over the ranks: its gradient is summed over TP), at PP2, at EP2, at CP2 (the DeltaNet's
all-to-all of key heads) and at DP2 under ZeRO-3 with every layer recomputed: the
language-model
loss, the balancing loss and the gradient norm, every iteration of 6, within 1e-5 relative
(fp32, no dropout, mock data)."""

from pathlib import Path

import pytest

from mp_gpt.config_files import config_path
from mp_gpt.testing import GIVEN_PEAK, assert_same_curve, metrics_records, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

ITERATIONS = 6
KEYS = ("lm loss", "load_balancing_loss", "grad_norm")


def options(run_dir: Path, *layout: str) -> list[str]:
    return [
        "--config", str(config_path("tiny-qwen3-next.yaml")), "--mock-data", *GIVEN_PEAK,
        "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", str(ITERATIONS), "--lr-warmup-iters", "2", "--eval-interval", "none",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"), *layout,
    ]  # fmt: skip


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "dp2-zero3-recompute": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                "optim_grads_params", "--recompute-granularity", "full",
                                "--recompute-method", "uniform", "--recompute-num-layers",
                                "1"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-rank")
    run_on_ranks(train_on_rank, 1, options(run_dir), timeout=300)
    records = metrics_records(run_dir)
    assert len(records) == ITERATIONS
    assert records[-1]["lm loss"] < records[0]["lm loss"] - 0.3, (records[0], records[-1])
    return records


@pytest.mark.parametrize("name", LAYOUTS)
def test_same_curve(tmp_path, reference, name):
    ranks, layout = LAYOUTS[name]
    run_on_ranks(train_on_rank, ranks, options(tmp_path, *layout), timeout=300)
    assert_same_curve(metrics_records(tmp_path), reference, KEYS, name)
