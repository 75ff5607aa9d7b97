"""A data-loader worker killed mid-run ends the job within 60 s, naming the rank and the
worker; the checkpoints committed before stay whole.

apps/gpt's pretrain_gpt under torchrun (two ranks, gloo), the tiny config on mock data
read by two workers per loader, as a user would run it. Torch's DataLoader notices a
dead worker at once (its SIGCHLD handler raises in the rank's main thread); the job used
to hang after that, the failing rank waiting in a teardown barrier for a peer that was
waiting for it in the next step's all-reduce.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_ckpt import CheckpointReader, read_tracker
from mp_gpt.testing import TINY_CONFIG
from mp_state.testing.processes import children, rank_of

DEADLINE = 60.0
"""How long after the kill the whole job may take to end."""


def command(run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "mp_gpt.pretrain",
        "--config", str(TINY_CONFIG), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "none",
        "--log-interval", "1000", "--num-workers", "2", "--tensorboard-dir", "none",
        "--lr-warmup-iters", "2", "--train-iters", "100000", "--save-interval", "3",
        "--save", str(run_dir / "ckpt"), "--load", "none",
        "--metrics-file", str(run_dir / "metrics.jsonl"),
    ]  # fmt: skip


def kill_everything(launcher: subprocess.Popen) -> None:
    """The launcher's group, and its ranks with their workers (torchrun starts each rank
    in a session of its own)."""
    for rank in children(launcher.pid):
        for pid in [*children(rank), rank]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.multirank
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_killed_loader_worker_ends_the_job_naming_rank_and_worker(tmp_path, victim_rank):
    launcher = subprocess.Popen(
        command(tmp_path), env={**os.environ, "MP_RUN_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"},
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Training has started and committed a checkpoint.
        deadline = time.monotonic() + 120
        while (read_tracker(tmp_path / "ckpt") or 0) < 3:
            assert launcher.poll() is None, launcher.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.1)
        ranks = {rank_of(pid): pid for pid in children(launcher.pid)}
        workers = children(ranks[victim_rank])
        assert len(workers) >= 2, workers  # the training loader's two, at least
        worker = workers[0]
        committed = read_tracker(tmp_path / "ckpt")
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        try:
            output, _ = launcher.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            kill_everything(launcher)
            output, _ = launcher.communicate()
            raise AssertionError(
                f"the job hung: still running {DEADLINE:.0f} s after worker {worker} of rank "
                f"{victim_rank} was killed\n{output[-3000:]}"
            ) from None
        took = time.monotonic() - killed
    except BaseException:
        kill_everything(launcher)
        raise

    assert launcher.returncode != 0, output[-3000:]
    assert took < DEADLINE
    # The failing rank's one line: its rank, the worker's pid and how it ended.
    said = f"error: rank {victim_rank}: DataLoader worker (pid {worker}) is killed by signal: "
    said += "Killed."
    errors = [e for e in output.splitlines() if e.startswith("error:")]
    if not any(e.startswith(said) for e in errors):
        print(output)  # the whole job's output, for the failure report
    assert any(e.startswith(said) for e in errors), (said, errors)
    # Nothing committed is lost: the checkpoint named before the kill (or a later one)
    # is the tracker's, complete, every file matching its recorded digest.
    latest = read_tracker(tmp_path / "ckpt")
    assert latest is not None and latest >= committed
    assert CheckpointReader(tmp_path / "ckpt").verify() == []
