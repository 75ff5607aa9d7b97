"""A rank stopped with SIGSTOP mid-run, or stuck in I/O: the job ends within its bound,
naming that rank.

apps/gpt's pretrain under torchrun (two ranks, gloo) with --hang-timeout-minutes 0.1
(6 s: a heartbeat every 1.2 s, a rank silent for 3.6 s counted as stopped; an iteration
takes well under a second here); once training runs, one rank gets SIGSTOP (or blocks
reading a pipe: blocking_rank.py). A watchdog must say which rank it is, have the ranks
dump their Python stacks and end the job, long before the collective's 10-minute timeout.
"""

import os
import re
import signal
import time
from pathlib import Path

import pytest

from mp_gpt.testing import tiny_options
from mp_state.testing import TorchrunJob
from mp_state.testing.processes import alive

HANG_TIMEOUT_S = 6
BOUND_S = 60  # the timeout, a few watchdog periods, and torchrun's teardown


def _iterations(run_dir: Path) -> int:
    """The metrics file's complete lines (one per iteration at --log-interval 1)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _job(run_dir: Path, target: list[str], **env: str) -> TorchrunJob:
    options = tiny_options(run_dir, "--train-iters", "100000", "--log-interval", "1",
                           "--hang-timeout-minutes", str(HANG_TIMEOUT_S / 60))  # fmt: skip
    return TorchrunJob([*target, *options], run_dir, env=env)


def _training(job: TorchrunJob, run_dir: Path) -> None:
    job.wait_for(lambda: _iterations(run_dir) >= 3, "training", timeout=240, poll=0.2)


@pytest.mark.multirank
def test_a_rank_stuck_in_io_is_shown_and_the_job_ends(tmp_path):
    script = str(Path(__file__).with_name("blocking_rank.py"))
    with _job(tmp_path, [script], BLOCK_RANK="1", BLOCK_AFTER="20") as job:
        _training(job, tmp_path)
        workers = list(job.workers().values())
        job.wait(timeout=BOUND_S + 60)
        output = job.output()
        assert job.returncode != 0
        # Both threads run, at the same iteration: the line says where each main thread
        # is, rank 1's in its read.
        verdict = next(line for line in output.splitlines() if "hang detected" in line)
        assert "stuck: rank 0, rank 1 all wait" in verdict, verdict
        assert re.search(r"rank 1 \(.*blocking_rank\.py:\d+ in forward_step\)", verdict), verdict
        # Every rank dumped its stacks, the judge's and the other on request.
        assert "Python stacks (hang detected)" in output
        assert "Python stacks (requested by rank" in output
        assert re.search(r'blocking_rank\.py", line \d+ in forward_step', output)
        assert not any(alive(pid) for pid in workers)


@pytest.mark.multirank
@pytest.mark.parametrize("stopped_rank", [1, 0])
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path, stopped_rank):
    with _job(tmp_path, ["-m", "mp_gpt.pretrain"]) as job:
        _training(job, tmp_path)
        # Two watchdog periods (1.2 s each) of training, so that the stopped rank has
        # published a finished iteration.
        time.sleep(2.5)
        workers = job.workers()
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[stopped_rank], signal.SIGSTOP)
        stopped = time.monotonic()
        job.wait(timeout=BOUND_S + 60)
        took = time.monotonic() - stopped
        output = job.output()
        print(f"figure: SIGSTOP of rank {stopped_rank}: the job ended {took:.1f} s later")
        assert job.returncode != 0
        assert f"stuck: rank {stopped_rank} stopped responding" in output, output[-4000:]
        assert f"rank {stopped_rank} (last finished iteration 0" not in output
        live = 1 - stopped_rank
        assert f"rank {live}: Python stacks (hang detected)" in output, output[-4000:]
        assert "Thread 0x" in output or "Current thread 0x" in output
        assert HANG_TIMEOUT_S / 2 < took < BOUND_S, output[-4000:]
        assert not any(alive(pid) for pid in workers.values())
