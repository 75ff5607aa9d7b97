"""A data-loader worker killed mid-run ends the job within 60 s, naming the rank and the
worker; the checkpoints committed before stay whole.

apps/gpt's pretrain_gpt under torchrun (two ranks, gloo), the tiny config on mock data
read by two workers per loader, as a user would run it. Torch's DataLoader notices a
dead worker at once (its SIGCHLD handler raises in the rank's main thread); the job used
to hang after that, the failing rank waiting in a teardown barrier for a peer that was
waiting for it in the next step's all-reduce.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from mp_ckpt import CheckpointReader, read_tracker
from mp_gpt.testing import GIVEN_PEAK, TINY_CONFIG
from mp_state.testing import TorchrunJob
from mp_state.testing.processes import children

DEADLINE = 60.0
"""How long after the kill the whole job may take to end."""


def target(run_dir: Path) -> list[str]:
    return [
        "-m", "mp_gpt.pretrain",
        "--config", str(TINY_CONFIG), "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "none",
        "--log-interval", "1000", "--num-workers", "2", "--tensorboard-dir", "none",
        "--lr-warmup-iters", "2", "--train-iters", "100000", "--save-interval", "3",
        "--save", str(run_dir / "ckpt"), "--load", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"),
    ]  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_killed_loader_worker_ends_the_job_naming_rank_and_worker(tmp_path, victim_rank):
    with TorchrunJob(target(tmp_path), tmp_path) as job:
        # Training has started and committed a checkpoint.
        job.wait_for(lambda: (read_tracker(tmp_path / "ckpt") or 0) >= 3, "a checkpoint",
                     timeout=120)  # fmt: skip
        workers = children(job.workers()[victim_rank])
        assert len(workers) >= 2, workers  # the training loader's two, at least
        worker = workers[0]
        committed = read_tracker(tmp_path / "ckpt")
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=DEADLINE)
        took = time.monotonic() - killed
    output = job.output()

    assert job.returncode != 0, output[-3000:]
    assert took < DEADLINE
    # The failing rank's one line: its rank, the worker's pid and how it ended (after
    # "saving iteration N into ... failed: " when the death interrupted a save: torch's
    # SIGCHLD handler raises wherever the rank's main thread is).
    said = f"DataLoader worker (pid {worker}) is killed by signal: Killed."
    errors = [e for e in output.splitlines() if e.startswith(f"error: rank {victim_rank}: ")]
    if not any(said in e for e in errors):
        print(output)  # the whole job's output, for the failure report
    assert any(said in e for e in errors), (said, errors)
    # Nothing committed is lost: the checkpoint named before the kill (or a later one)
    # is the tracker's, complete, every file matching its recorded digest.
    latest = read_tracker(tmp_path / "ckpt")
    assert latest is not None and latest >= committed
    assert CheckpointReader(tmp_path / "ckpt").verify() == []
    print(f"figure: a loader worker of rank {victim_rank} killed: the job ended {took:.1f} s "
          "later")  # fmt: skip
