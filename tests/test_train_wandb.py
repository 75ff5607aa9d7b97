"""Weights & Biases through the real loop, with a stand-in `wandb` module (the package is not
installed here): the run starts it with Megatron's settings (--wandb-project,
--wandb-exp-name, --wandb-entity, --wandb-save-dir), logs the loss under Megatron's tag
every iteration and finishes it."""

import sys
import types

import pytest

from mp_gpt.testing import tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def recorded_on_rank(argv: list[str]) -> dict:
    calls: dict = {"log": [], "finished": False}

    class Run:
        def log(self, values, step):
            calls["log"].append((step, sorted(values)))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = {k: kwargs[k] for k in ("project", "name", "entity", "dir")}
        return Run()

    sys.modules["wandb"] = types.SimpleNamespace(init=init)
    assert train_on_rank(argv) == 0
    return calls


def test_wandb_gets_megatrons_settings_and_the_loss(tmp_path):
    argv = tiny_options(tmp_path, "--train-iters", "2", "--wandb-project", "proj",
                        "--wandb-exp-name", "exp", "--wandb-entity", "team",
                        "--wandb-save-dir", str(tmp_path / "wandb"))  # fmt: skip
    (calls,) = run_on_ranks(recorded_on_rank, 1, argv, timeout=300)
    assert calls["init"] == {"project": "proj", "name": "exp", "entity": "team",
                             "dir": str(tmp_path / "wandb")}  # fmt: skip
    steps = [step for step, tags in calls["log"] if "lm loss" in tags]
    assert steps == [1, 2] and calls["finished"]
