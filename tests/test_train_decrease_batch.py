"""Megatron's --decrease-batch-size-if-needed, end to end: a global batch that the layout
does not divide trains as the largest multiple below it, on the schedule of the batch
asked for."""

import pytest

from mp_gpt.testing import assert_same_curve, tiny_curve

pytestmark = pytest.mark.multirank


def test_a_decreased_batch_trains_as_that_batch_on_the_asked_schedule(tmp_path):
    common = ["--micro-batch-size", "1", "--train-iters", "4", "--lr-warmup-iters", "0"]
    # 3 asked at dp 2: 2 trained. The schedule counts 4 x 3 = 12 samples to decay over, of
    # which each iteration consumes 2: as a batch of 2 decaying over 6 iterations.
    decreased = tiny_curve(tmp_path / "decreased", 2, *common, "--global-batch-size", "3",
                           "--lr-decay-iters", "4", "--decrease-batch-size-if-needed")  # fmt: skip
    plain = tiny_curve(tmp_path / "plain", 2, *common, "--global-batch-size", "2",
                       "--lr-decay-iters", "6")  # fmt: skip
    assert [r["global_batch_size"] for r in decreased] == [2, 2, 2, 2]
    assert_same_curve(decreased, plain, ["lm loss", "grad_norm", "lr"], "decreased")
    assert decreased[-1]["lr"] > 0.1 * decreased[0]["lr"]  # not decayed over 4 iterations
