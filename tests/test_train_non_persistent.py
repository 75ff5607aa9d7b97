"""Megatron's non-persistent checkpoints (--non-persistent-save-interval, type global) and
--override-ckpt-iteration, end to end on the tiny model."""

import pytest

from mp_ckpt import list_iterations, read_tracker
from mp_gpt.testing import assert_same_curve, tiny_curve

pytestmark = pytest.mark.multirank

NON_PERSISTENT = ["--non-persistent-save-interval", "3", "--non-persistent-ckpt-type", "global"]


def test_a_run_resumes_from_the_newest_non_persistent_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    saving = ["--train-iters", "8", "--save", str(save), "--load", str(save),
              "--save-interval", "4"]  # fmt: skip
    whole = tiny_curve(tmp_path / "whole", 1, "--train-iters", "8")
    # Iteration 3 non-persistent, 4 persistent, 6 non-persistent (3 deleted), then the
    # exit, with no save of its own: 6 is saved.
    first = tiny_curve(tmp_path / "first", 1, *saving, *NON_PERSISTENT, "--exit-interval", "6")
    assert [r["iteration"] for r in first] == list(range(1, 7))
    assert list_iterations(save) == [4] and list_iterations(save / "non_persistent") == [6]
    resumed = tiny_curve(tmp_path / "resumed", 1, *saving, *NON_PERSISTENT)
    assert_same_curve(first + resumed, whole, ["lm loss", "grad_norm", "lr"], "resumed at 6")
    # The end of training saves a persistent checkpoint, as Megatron does.
    assert read_tracker(save) == 8 and list_iterations(save / "non_persistent") == [6]


def test_override_ckpt_iteration_replays_the_data_from_that_iteration(tmp_path):
    save = tmp_path / "ckpt"
    whole = tiny_curve(tmp_path / "whole", 1, "--train-iters", "8", "--save", str(save),
                       "--save-interval", "4")  # fmt: skip
    # From iteration 4's checkpoint as if it were 2's: iterations 3 and 4 again, on
    # their samples (8 consumed before them), with the weights and the learning-rate
    # schedule of iteration 4 (its next rate is iteration 5's).
    again = tiny_curve(tmp_path / "again", 1, "--train-iters", "8", "--load", str(save),
                       "--ckpt-step", "4", "--override-ckpt-iteration", "2")  # fmt: skip
    assert [(r["iteration"], r["consumed_samples"]) for r in again[:2]] == [(3, 12), (4, 16)]
    assert [r["iteration"] for r in again] == list(range(3, 9))
    assert again[0]["lr"] == whole[4]["lr"] and again[1]["lr"] == whole[5]["lr"]
    assert again[0]["lm loss"] != whole[2]["lm loss"]  # iteration 4's weights
