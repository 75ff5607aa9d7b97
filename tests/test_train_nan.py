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


def printed_and_recorded(argv) -> tuple[str, list[dict]]:
    import io
    from contextlib import redirect_stdout

    from mp_gpt.testing import metrics_records

    out = io.StringIO()
    with redirect_stdout(out):
        run = train_run_on_rank(argv)
    path = Path(run.config.logging.metrics_file)
    return out.getvalue(), metrics_records(path.parent) if path.exists() else []


@pytest.mark.multirank
def test_the_log_line_averages_the_losses_of_the_steps_taken(tmp_path):
    """As Megatron's: a skipped step's loss is left out of the line's average (a nan
    loss skipped here made the whole line's loss nan), and a line whose steps were all
    skipped shows no loss. Each line's loss is the mean of its taken steps' recorded
    losses, and its skipped and nan iterations are those of its interval."""
    argv = [*DIVERGING, "--skip-nan-loss-iterations", "--log-interval", "5",
            "--metrics-file", str(tmp_path / "metrics.jsonl")]  # fmt: skip
    printed, records = run_on_ranks(printed_and_recorded, 1, argv, timeout=120)[0]
    lines = [line for line in printed.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 6 and len(records) == 30
    mixed = 0
    for index, line in enumerate(lines):
        interval = records[5 * index : 5 * index + 5]
        taken = [r["lm loss"] for r in interval if not r["skipped"]]
        mixed += 0 < len(taken) < 5
        # the interval's skipped steps (all for a nan loss here), not the run's so far
        skipped = len(interval) - len(taken)
        assert f" | skipped iterations {skipped} | nan iterations {skipped} | " in line, line
        if taken:
            shown = float(line.split(" | lm loss ")[1].split(" |")[0])
            assert shown == pytest.approx(sum(taken) / len(taken), rel=1e-3), line
        else:
            assert " | lm loss " not in line, line
    assert mixed and not all(r["skipped"] is False for r in records)
