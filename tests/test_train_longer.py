"""Resuming with a larger train_iters: refused by default naming the flags (as Megatron-LM),
trained further with --override-opt-param-scheduler."""

from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK, train_run_on_rank
from mp_state.testing import RankFailure, run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"


def argv(ckpt: Path, iterations: int, *extra: str) -> list[str]:
    return [
        "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", str(iterations), "--eval-interval", "none",
        "--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", "none",
        "--num-workers", "0", "--log-interval", "100", "--lr-warmup-iters", "1", *extra,
    ]  # fmt: skip


def body(argv):
    run = train_run_on_rank(argv)
    return run.train.iteration, run.scheduler.lr_decay_steps


@pytest.mark.multirank
def test_a_longer_run_needs_the_override_flag(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run_on_ranks(body, 1, argv(ckpt, 3), timeout=120) == [(3, 6)]
    message = r"lr_decay_steps=12 differs .* lr_decay_steps=6 .*--override-opt-param-scheduler"
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(body, 1, argv(ckpt, 6), timeout=120)
    longer = argv(ckpt, 6, "--override-opt-param-scheduler")
    assert run_on_ranks(body, 1, longer, timeout=120) == [(6, 12)]
