"""--use-device-initialization: the model is built on the run's device and its weights
drawn there (under mp_layers.building_on). On the CPU that is where they were drawn
anyway, so a TP2 run's losses are bitwise those of the run without the flag (the whole
build under the device context); on a GPU (NCCL, one rank) the run trains from weights
drawn by the GPU's generator."""

import contextlib
import json
import math
from pathlib import Path

import pytest

import mp_train.loop.setup
from mp_gpt.testing import metrics_records, tiny_options, train_on_rank
from mp_state.testing import TorchrunJob, run_on_ranks


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


@pytest.mark.cuda
def test_on_a_gpu_a_run_trains_from_weights_drawn_there(tmp_path):
    options = tiny_options(tmp_path, "--bf16", "--use-device-initialization")
    with TorchrunJob(["-m", "mp_gpt.pretrain", *options], tmp_path, nproc=1,
                     device="cuda") as job:  # fmt: skip
        job.wait(timeout=300)
    assert job.returncode == 0, job.output()[-4000:]
    assert "backend nccl, device cuda:0" in job.output()
    first, *rest = [record["lm loss"] for record in metrics_records(tmp_path)]
    assert rest and all(math.isfinite(loss) for loss in rest)
    # Weights drawn at std 0.02 predict about uniformly: the first loss is near ln(vocab).
    assert abs(first - math.log(1024)) < 0.5, first
