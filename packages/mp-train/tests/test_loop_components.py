"""The loop's components on their own, without ranks: the NaN/skip policy."""

from types import SimpleNamespace

import pytest

from mp_train import TrainingConfig, TrainState
from mp_train.loop.skip_policy import SkipPolicy

NAN, INF = float("nan"), float("inf")
UPDATED = SimpleNamespace(update_successful=True)
NOT_UPDATED = SimpleNamespace(update_successful=False)


def run_policy(training: TrainingConfig, iterations, other_ranks_bad=()):
    """Runs the policy over (losses, result of a step) per iteration, as the loop does;
    `other_ranks_bad`: iterations where another rank's loss was not finite. Returns the
    counters and, per iteration, (took a step, updated)."""
    counters, seen, asked = TrainState(), [], []

    def any_rank(flag: bool) -> bool:
        asked.append(flag)
        return flag or len(seen) + 1 in other_ranks_bad

    policy = SkipPolicy(training, counters, any_rank=any_rank)
    for losses, result in iterations:
        step = policy.takes_step(losses, counters.iteration + 1)
        counters.iteration += 1
        seen.append((step, policy.updated(result if step else None)))
    return counters, seen, asked


def test_skip_policy_counts_nan_and_skipped_iterations():
    good, bad = {"lm loss": 2.5}, {"lm loss": NAN, "z_loss": 0.1}
    skipping = TrainingConfig(skip_nan_loss_iterations=True)
    counters, seen, asked = run_policy(
        skipping,
        [(good, UPDATED), (bad, UPDATED), (good, NOT_UPDATED), ({"lm loss": INF}, UPDATED),
         ({}, UPDATED), (good, UPDATED)],
        other_ranks_bad={5},
    )  # fmt: skip
    assert seen == [(True, True), (False, False), (True, False), (False, False),
                    (False, False), (True, True)]  # fmt: skip
    assert (counters.nan_iterations, counters.skipped_iterations) == (3, 4)
    assert asked == [False, True, False, True, False, False]  # each rank's own flag
    # Checking and stopping (the default): the error names the rank, its losses, the iteration.
    with pytest.raises(FloatingPointError, match=r"rank 0: loss \{'lm loss': nan.* iteration 2 "):
        run_policy(TrainingConfig(), [(good, UPDATED), (bad, UPDATED)])
    with pytest.raises(FloatingPointError, match="rank 0: a rank of the last pipeline stage"):
        run_policy(TrainingConfig(), [({}, UPDATED)], other_ranks_bad={1})
    # Not checking: no collective, a nan loss steps; only a failed update is skipped.
    unchecked = TrainingConfig(check_for_nan_in_loss_and_grad=False)
    counters, seen, asked = run_policy(unchecked, [(bad, UPDATED), (bad, NOT_UPDATED)])
    assert seen == [(True, True), (True, False)] and asked == []
    assert (counters.nan_iterations, counters.skipped_iterations) == (0, 1)
