"""Evaluation runs and reports what it measured; with eval_iters=0 there is none (Megatron's
do_valid), and no empty "validation |" line."""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, train_printed_on_rank
from mp_state.testing import run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"
ARGV = [
    "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "4", "--eval-interval", "2",
    "--save", "none", "--load", "none", "--tensorboard-dir", "none", "--num-workers", "0",
    "--log-interval", "100", "--lr-warmup-iters", "0",
]  # fmt: skip


def body(argv):
    return [line for line in train_printed_on_rank(argv).splitlines() if "validation" in line]


@pytest.mark.multirank
def test_validation_lines_carry_the_loss():
    lines = run_on_ranks(body, 1, [*ARGV, "--eval-iters", "1"], timeout=120)[0]
    assert [line.split(" | ")[0] for line in lines] == [
        "validation at iteration 2",
        "final validation",  # the last iteration's evaluation is the final one
    ]
    assert all(" | lm loss " in line for line in lines)


@pytest.mark.multirank
def test_eval_iters_zero_evaluates_nothing():
    assert run_on_ranks(body, 1, [*ARGV, "--eval-iters", "0"], timeout=120)[0] == []
