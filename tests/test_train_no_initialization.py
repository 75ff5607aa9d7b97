"""--no-initialization (Megatron's flag): a run resumed from a checkpoint with its weights
built undrawn (mp_layers.skipping_draws) trains on exactly as the one that drew them
first, at DP2 and at PP2 (tied embeddings: the last stage's copy comes from the
checkpoint too); with no checkpoint to load it stops, naming why, instead of training
uninitialized memory."""

import json
from pathlib import Path

import pytest

from mp_gpt.testing import tiny_options, train_on_rank
from mp_state.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multirank


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["lm loss"] for line in lines]


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]],
                         ids=["dp2", "pp2"])  # fmt: skip
def test_a_resume_with_undrawn_weights_trains_on_as_the_drawn_one(tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    first = tiny_options(tmp_path / "first", "--train-iters", "4", "--log-interval", "1",
                         "--save", str(ckpt), "--save-interval", "2", "--exit-interval", "2",
                         *layout)  # fmt: skip
    assert run_on_ranks(train_on_rank, 2, first, timeout=180) == [0, 0]
    for name, extra in (("drawn", []), ("undrawn", ["--no-initialization"])):
        argv = tiny_options(tmp_path / name, "--train-iters", "4", "--log-interval", "1",
                            "--load", str(ckpt), *layout, *extra)  # fmt: skip
        assert run_on_ranks(train_on_rank, 2, argv, timeout=180) == [0, 0], name
    drawn, undrawn = losses(tmp_path / "drawn"), losses(tmp_path / "undrawn")
    assert len(drawn) == 2 and undrawn == drawn


def test_with_no_checkpoint_to_load_the_run_stops_naming_why(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = tiny_options(tmp_path, "--load", str(empty), "--no-initialization")
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(train_on_rank, 1, argv, timeout=180)
    assert f"--no-initialization: --load {empty} holds no checkpoint" in str(failure.value)
