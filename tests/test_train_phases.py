"""Megatron's --phase-transition-iterations, end to end on the tiny model: the run saves
and exits at the end of a phase, and the next phase reads its samples from its own start."""

import pytest

from mp_ckpt import read_tracker
from mp_gpt.testing import assert_same_curve, tiny_curve

pytestmark = pytest.mark.multirank

LOGGED = ["lm loss", "grad_norm", "lr"]


def test_the_next_phase_reads_its_samples_from_its_start(tmp_path):
    save = tmp_path / "ckpt"
    fixed = ["--lr-decay-iters", "6", "--save", str(save), "--load", str(save)]
    phases = ["--phase-transition-iterations", "3", "--train-iters", "6"]
    first = tiny_curve(tmp_path / "first", 1, *fixed, *phases)
    assert [r["iteration"] for r in first] == [1, 2, 3] and read_tracker(save) == 3
    second = tiny_curve(tmp_path / "second", 1, *fixed, *phases)
    assert [(r["iteration"], r["consumed_samples"]) for r in second] == [
        (4, 16), (5, 20), (6, 24)]  # fmt: skip
    # The same three steps from the same checkpoint, the data rewound to sample 0 by
    # --override-ckpt-iteration 0 (no phases): the samples the new phase reads.
    rewound = tiny_curve(tmp_path / "rewound", 1, "--lr-decay-iters", "6", "--load", str(save),
                         "--ckpt-step", "3", "--override-ckpt-iteration", "0",
                         "--train-iters", "3", "--use-checkpoint-opt-param-scheduler")  # fmt: skip
    for reference in rewound:
        reference["iteration"] += 3
        reference["consumed_samples"] += 12
    assert_same_curve(second, rewound, LOGGED, "the second phase")
    # Without phases the resumed run reads on at sample 12: other samples, other losses.
    on = tiny_curve(tmp_path / "on", 1, "--lr-decay-iters", "6", "--load", str(save),
                    "--ckpt-step", "3", "--train-iters", "6")  # fmt: skip
    assert [r["lm loss"] for r in on] != [r["lm loss"] for r in second]
