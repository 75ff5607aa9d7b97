"""With reruns disabled, a nan or inf loss stops the run naming the rank; by option it is
skipped. (With rerun_mode validate_results, the default, the iteration is run again
first: tests/test_train_rerun.py.)"""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, train_run_on_rank
from mp_state.testing import RankFailure, run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"
DIVERGING = [
    "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "30", "--eval-interval", "none",
    "--save", "none", "--load", "none", "--tensorboard-dir", "none", "--num-workers", "0",
    "--lr", "1e12", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "0",
    "--log-interval", "100",
]  # fmt: skip


def body(argv):
    run = train_run_on_rank(argv)
    return run.train.nan_iterations, run.train.iteration


@pytest.mark.multirank
def test_a_nan_loss_stops_every_rank_naming_one():
    with pytest.raises(RankFailure, match=r"rank \d: loss .* is nan or inf at iteration \d+"):
        run_on_ranks(body, 2, [*DIVERGING, "--rerun-mode", "disabled"], timeout=120)


@pytest.mark.multirank
def test_skip_nan_loss_iterations_goes_on():
    results = run_on_ranks(body, 2, [*DIVERGING, "--skip-nan-loss-iterations"], timeout=120)
    for nan_iterations, iteration in results:
        assert iteration == 30 and nan_iterations > 0
