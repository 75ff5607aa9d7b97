"""A signal to one rank of a running job, as a scheduler or the kernel sends it.

- SIGTERM (a preemption notice; --exit-signal-handler), or SIGUSR1 with --exit-signal
  SIGUSR1: every rank saves at the same iteration and the job exits 0, within seconds.
- SIGKILL (the out-of-memory killer), without restarts: the job ends within its bound,
  torchrun names the killed rank and the signal, and the checkpoints committed before are
  whole.

apps/gpt's pretrain under torchrun (two ranks, gloo), the tiny config on mock data.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from mp_ckpt import CheckpointReader, read_tracker
from mp_gpt.testing import complete_records, tiny_options
from mp_state.testing import TorchrunJob

BOUND_S = 60.0
"""How long after the signal the whole job may take to end."""


def target(run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "mp_gpt.pretrain", *tiny_options(
        run_dir, "--train-iters", "100000", "--log-interval", "1", "--save-interval", "3",
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), *extra,
    )]  # fmt: skip


def children(pid: int) -> list[int]:
    """The child processes of `pid` (a rank's data-loader workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_sigterm_to_one_rank_saves_and_exits_zero(tmp_path, name):
    """SIGTERM, or with --exit-signal SIGUSR1 (a scheduler's early warning) that one. The
    SIGTERM run reads with a loader worker per loader, and rank 1's get the signal too (as
    SLURM signals every process of a job step): they ignore it, and the rank saves."""
    flags = ["--exit-signal-handler", "--exit-signal", name]
    if name == "SIGTERM":
        flags += ["--num-workers", "1"]
    with TorchrunJob(target(tmp_path, *flags), tmp_path) as job:
        job.wait_for(lambda: len(complete_records(tmp_path)) >= 3, "three iterations")
        rank = job.workers()[1]
        loaders = children(rank) if name == "SIGTERM" else []  # training's and validation's
        assert bool(loaders) == (name == "SIGTERM")
        for pid in [*loaders, rank]:
            os.kill(pid, signal.Signals[name])
        took = job.wait(timeout=BOUND_S)
    output = job.output()
    assert job.returncode == 0, output[-4000:]
    assert f"{name} received" in output
    saved = read_tracker(tmp_path / "ckpt")
    # The save is of the last iteration trained: nothing done is lost.
    assert saved is not None and saved == complete_records(tmp_path)[-1]["iteration"]
    assert CheckpointReader(tmp_path / "ckpt").verify() == []
    print(f"figure: {name} to rank 1: saved iteration {saved}, exit 0, {took:.1f} s")


@pytest.mark.multirank
def test_sigkill_of_one_rank_ends_the_job_naming_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    with TorchrunJob(target(tmp_path), tmp_path) as job:
        job.wait_for(lambda: (read_tracker(ckpt) or 0) >= 3, "a first checkpoint")
        committed = read_tracker(ckpt)
        workers = job.workers()
        survivor, victim = workers[0], workers[1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=BOUND_S)
        took = time.monotonic() - killed
    output = job.output()
    assert job.returncode != 0
    # torchrun's summary: the first failure is rank 1's, by SIGKILL.
    summary = output[output.rindex("Root Cause") :]
    assert "rank      : 1" in summary, summary
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in summary, summary
    # The survivor says why it stopped (its peer is gone), unless torchrun, having seen the
    # kill first, ended it with SIGTERM before it was scheduled again: a race the kernel's
    # scheduler decides, which a loaded machine sometimes loses.
    ended_by_torchrun = f"exitcode  : -15 (pid: {survivor})" in output
    assert ended_by_torchrun or "error: rank 0: " in output, output[-4000:]
    # Nothing committed is lost.
    assert (read_tracker(ckpt) or 0) >= committed
    assert CheckpointReader(ckpt).verify() == []
    print(f"figure: SIGKILL of rank 1, no restarts: the job ended {took:.1f} s after the kill")
