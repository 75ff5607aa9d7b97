"""--use-device-initialization: the model is built on the run's device and its weights
drawn there (under mp_layers.building_on). On the CPU that is where they were drawn
anyway, so a TP2 run's losses are bitwise those of the run without the flag (the whole
build under the device context). On a GPU, test_cuda_train_generate.py trains with it."""

import contextlib
import json
from pathlib import Path

import pytest

import mp_train.loop.setup
from mp_gpt.testing import tiny_options, train_on_rank
from mp_state.testing import run_on_ranks


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["lm loss"] for line in lines]


@pytest.mark.multirank
def test_on_the_cpu_the_flag_changes_no_loss(tmp_path, monkeypatch):
    built_on = tmp_path / "built-on.txt"
    real = mp_train.loop.setup.building_on

    @contextlib.contextmanager
    def noted(device):  # the forked ranks write down each build under the flag
        with built_on.open("a") as out:
            out.write(f"{device}\n")
        with real(device):
            yield

    monkeypatch.setattr(mp_train.loop.setup, "building_on", noted)
    for name, extra in (("cpu", []), ("device", ["--use-device-initialization"])):
        argv = tiny_options(tmp_path / name, "--train-iters", "3", "--log-interval", "1",
                            "--tensor-model-parallel-size", "2", *extra)  # fmt: skip
        assert run_on_ranks(train_on_rank, 2, argv, timeout=180) == [0, 0], name
    plain, device = losses(tmp_path / "cpu"), losses(tmp_path / "device")
    assert len(plain) == 3 and device == plain
    assert built_on.read_text().split() == ["cpu", "cpu"]  # each rank's one chunk, flagged
