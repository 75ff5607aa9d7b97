"""--optimizer lion end to end: apps/gpt's tiny config (fp32, 4 iterations) trains at DP2
with the distributed optimizer and under ZeRO-3 (each rank stepping its shard of every
parameter: Lion's update is elementwise) to the one-rank curve, and the one-rank run's
save of iteration 2 (Lion's momentum) resumes at DP2 with the distributed optimizer to
the rest of that curve."""

import shutil

import pytest

from mp_ckpt.core.layout import TRACKER
from mp_gpt.testing import assert_same_curve, metrics_records, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

LION = ["--optimizer", "lion", "--lr", "3e-4", "--weight-decay", "0.1",
        "--lion-beta1", "0.9", "--lion-beta2", "0.99"]  # fmt: skip
LOGGED = ("lm loss", "grad_norm")


def test_lion_trains_sharded_as_one_rank_and_resumes(tmp_path):
    one = tmp_path / "one"
    saves = ["--save", str(one / "ckpt"), "--save-interval", "2"]
    run_on_ranks(train_on_rank, 1, tiny_options(one, *LION, *saves), timeout=300)
    want = metrics_records(one)
    assert len(want) == 4 and want[-1]["lm loss"] < want[0]["lm loss"]
    for name, flags in (("distopt", ["--use-distributed-optimizer"]),
                        ("zero3", ["--use-megatron-fsdp"])):  # fmt: skip
        run_on_ranks(train_on_rank, 2, tiny_options(tmp_path / name, *LION, *flags),
                     timeout=300)  # fmt: skip
        assert_same_curve(metrics_records(tmp_path / name), want, LOGGED, name)
    resumed = tmp_path / "resumed"
    shutil.copytree(one / "ckpt" / "iter_0000002", resumed / "ckpt" / "iter_0000002")
    (resumed / "ckpt" / TRACKER).write_text("2")
    load = ["--load", str(resumed / "ckpt"), "--use-distributed-optimizer"]
    run_on_ranks(train_on_rank, 2, tiny_options(resumed, *LION, *load), timeout=300)
    assert_same_curve(metrics_records(resumed), want[2:], LOGGED, "resumed at DP2")
