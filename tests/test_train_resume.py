"""Killed runs resume exactly, dropout included; SIGTERM to one rank makes every rank
save and exit 0.

Both run apps/gpt's pretrain_gpt under torchrun (two ranks, gloo), as a user
would, on the tiny config with mock data; the uninterrupted run the killed one is
compared with goes on two forked ranks.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_ckpt import read_tracker
from mp_gpt.testing import complete_records
from mp_state.testing import run_on_ranks
from mp_state.testing.processes import alive, children

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "mp_gpt.pretrain", *options(run_dir, *extra)]  # fmt: skip


def options(run_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(CONFIG), "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "none",
        "--log-interval", "100", "--num-workers", "0", "--tensorboard-dir", "none",
        "--lr-warmup-iters", "2",
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"),
        "--metrics-file", str(run_dir / "metrics.jsonl"), *extra,
    ]  # fmt: skip


def environment(run_dir: Path) -> dict:
    return {**os.environ, "MP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}


def _wait_until_gone(pids: list[int], timeout: float = 30) -> None:
    """Until the processes are gone (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} outlived SIGKILL")
        time.sleep(0.05)


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(run_dir, *extra), env=environment(run_dir),
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait_for(process: subprocess.Popen, condition, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run exited early:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError("the condition never held")
        time.sleep(0.1)


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, output[-3000:]
    return output


# Megatron's default dropout, so that every rank's generators and streams must come back
# from the checkpoint for the losses to.
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"]}
ITERATIONS = 16


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sigkill_every_rank_then_rerun_continues_bitwise(tmp_path, layout):
    iterations = ["--train-iters", str(ITERATIONS), "--save-interval", "2", *DROPOUT,
                  *LAYOUTS[layout]]  # fmt: skip
    # The uninterrupted run on forked ranks (spared a torchrun start-up): the same code
    # and settings, one thread per rank as under torchrun with OMP_NUM_THREADS=1.
    reference = tmp_path / "reference"
    run_on_ranks(pretrain_body, 2, options(reference, *iterations), str(reference), timeout=180)
    want = {r["iteration"]: r for r in complete_records(reference)}
    assert sorted(want) == list(range(1, ITERATIONS + 1))

    killed = tmp_path / "killed"
    process = start(killed, *iterations)
    wait_for(process, lambda: (read_tracker(killed / "ckpt") or 0) >= 4)
    # Every rank and the launcher, mid-run (torchrun starts its workers in sessions of
    # their own, so the launcher's group alone would leave them running).
    workers = children(process.pid)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    _wait_until_gone(workers)
    saved = read_tracker(killed / "ckpt")
    seen = len(complete_records(killed))
    # Iterations past the checkpoint are redone.
    assert 4 <= saved < ITERATIONS and seen >= saved
    output = finish(start(killed, *iterations))
    assert f"at iteration {saved}" in output and "RNG states not restored" not in output
    after = complete_records(killed)
    assert len(after) == seen + ITERATIONS - saved  # the rerun's iterations, appended
    resumed = after[seen:]
    assert [r["iteration"] for r in resumed] == list(range(saved + 1, ITERATIONS + 1))
    for record in resumed:
        expected = want[record["iteration"]]
        assert record["consumed_samples"] == expected["consumed_samples"]  # none skipped
        assert record["lm loss"] == expected["lm loss"], record["iteration"]
        assert record["lr"] == expected["lr"] and record["grad_norm"] == expected["grad_norm"]


def pretrain_body(argv: list[str], run_dir: str) -> None:
    os.environ["MP_RUN_DIR"] = run_dir
    from mp_gpt.pretrain import train
    from mp_train import parse_config

    train(parse_config(argv))


@pytest.mark.multirank
def test_sigterm_to_one_rank_saves_and_exits_zero(tmp_path):
    process = start(tmp_path, "--train-iters", "1000", "--exit-signal-handler")
    wait_for(process, lambda: len(complete_records(tmp_path)) >= 3)
    workers = children(process.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGTERM)
    sent = time.monotonic()
    output = finish(process, timeout=60)
    assert time.monotonic() - sent < 60
    assert "SIGTERM received" in output
    saved = read_tracker(tmp_path / "ckpt")
    assert saved is not None and saved == complete_records(tmp_path)[-1]["iteration"] < 1000
