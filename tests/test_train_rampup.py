"""The batch-size ramp end to end: the global batch grows with the consumed samples.

rampup_batch_size = [4, 4, 24] towards a global batch of 12 over 60 samples:
the batch is 4 for the first 12 samples, 8 for the next 12, then 12, so the
run takes 8 iterations. At DP1 (more micro-batches per rank) and DP2 the
schedule is the same and so is the loss curve: every sample is consumed
once, in the same order. Megatron-LM's --step-batch-size-schedule written for the same
batches ("0:4 768:8 1536:12": 12 and 24 samples of 64 tokens) trains the same curve,
to the bit.
"""

import json
from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, TINY_CONFIG, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

EXPECTED_BATCHES = [4, 4, 4, 8, 8, 12, 12, 12]


def options(run_dir: Path) -> list[str]:
    return [
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "12",
        "--rampup-batch-size", "4", "4", "24", "--train-samples", "60",
        "--train-iters", "none", "--lr-decay-samples", "60", "--lr-warmup-samples", "8",
        "--lr-warmup-iters", "0",
        "--eval-interval", "none", "--log-interval", "4", "--save", "none", "--load", "none",
        "--tensorboard-dir", "none", "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--num-workers", "0",
    ]  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ramped(tmp_path_factory) -> dict[int, list[dict]]:
    rows = {}
    for dp in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"dp{dp}")
        run_on_ranks(train_on_rank, dp, options(run_dir), timeout=300)
        rows[dp] = records(run_dir)
    return rows


def test_the_global_batch_ramps_up_alike_at_dp1_and_dp2(ramped):
    curves = {}
    for dp in (1, 2):
        rows = ramped[dp]
        assert [r["global_batch_size"] for r in rows] == EXPECTED_BATCHES, f"dp{dp}"
        consumed = [r["consumed_samples"] for r in rows]
        assert consumed == [sum(EXPECTED_BATCHES[: i + 1]) for i in range(len(rows))], f"dp{dp}"
        curves[dp] = [r["lm loss"] for r in rows]
    for iteration, (got, want) in enumerate(zip(curves[2], curves[1], strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"iteration {iteration}: {got} vs {want}"


def test_a_step_schedule_of_the_same_batches_trains_the_same_curve(tmp_path, ramped):
    ramp = options(tmp_path).index("--rampup-batch-size")
    stepped = options(tmp_path)
    del stepped[ramp : ramp + 4]
    stepped += ["--global-batch-size", "none", "--step-batch-size-schedule", "0:4 768:8 1536:12"]
    run_on_ranks(train_on_rank, 2, stepped, timeout=300)
    rows = records(tmp_path)
    assert [r["global_batch_size"] for r in rows] == EXPECTED_BATCHES
    assert [r["lm loss"] for r in rows] == [r["lm loss"] for r in ramped[2]]
