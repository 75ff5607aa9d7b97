"""Loading a checkpoint of another model is an error listing every differing field."""

from pathlib import Path

import pytest

from mp_gpt.testing import train_run_on_rank
from mp_state.testing import RankFailure, run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"


def options(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(CONFIG), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "none",
        "--save", str(run_dir), "--load", str(run_dir), "--tensorboard-dir", "none",
        "--num-workers", "0", "--lr-warmup-iters", "0", "--log-interval", "100", *extra,
    ]  # fmt: skip


def body(argv):
    return train_run_on_rank(argv).train.iteration


@pytest.mark.multirank
def test_another_model_shape_is_refused_naming_the_fields(tmp_path):
    assert run_on_ranks(body, 1, options(tmp_path), timeout=120) == [2]
    changed = options(tmp_path, "--hidden-size", "64", "--num-layers", "2", "--train-iters", "4")
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(body, 1, changed, timeout=120)
    message = str(failure.value)
    assert "cannot be resharded" in message
    assert "num_layers: checkpoint 4, this run 2" in message
    assert "hidden_size: checkpoint 128, this run 64" in message
