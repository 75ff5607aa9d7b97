"""A rank killed mid-run under `torchrun --max-restarts 1`: torchrun restarts the workers,
they resume from the latest complete checkpoint with the unchanged command, redo at
most save_interval iterations, finish with exit 0, and the losses after the restart are
the uninterrupted run's, bit for bit; with checkpoints saved in the foreground and in
the background (--async-save).

The killed run goes under torchrun as a user would launch it; the uninterrupted run it
is compared with goes on two forked ranks (the same code and settings, spared a
torchrun start-up).
"""

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mp_ckpt import read_tracker
from mp_gpt.testing import complete_records, tiny_options, train_on_rank
from mp_state.testing import run_on_ranks
from mp_state.testing.processes import workers_of

ITERATIONS = 16
SAVE_INTERVAL = 4


SAVING = {"sync": [], "async": ["--async-save"]}


def options(run_dir: Path, saving: str) -> list[str]:
    return tiny_options(
        run_dir, "--train-iters", str(ITERATIONS), "--save-interval", str(SAVE_INTERVAL),
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), *SAVING[saving],
    )  # fmt: skip


def wait_for(process: subprocess.Popen, condition, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run exited before {what}:\n{process.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened within {timeout} s")
        time.sleep(0.05)


@pytest.mark.multirank
@pytest.mark.parametrize("saving", sorted(SAVING))
def test_killed_rank_restarts_and_resumes_bitwise(tmp_path, saving):
    reference = tmp_path / "reference"
    run_on_ranks(train_on_rank, 2, options(reference, saving), timeout=240)
    want = {r["iteration"]: r for r in complete_records(reference)}
    assert sorted(want) == list(range(1, ITERATIONS + 1))

    run_dir = tmp_path / "restarted"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts", "1", "-m", "mp_gpt.pretrain",
               *options(run_dir, saving)]  # fmt: skip
    env = {**os.environ, "MP_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, start_new_session=True, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    workers: dict[int, int] = {}
    try:
        # Past the first save: an iteration after it is logged.
        wait_for(process, lambda: (read_tracker(run_dir / "ckpt") or 0) >= SAVE_INTERVAL
                 and any(r["iteration"] > SAVE_INTERVAL for r in complete_records(run_dir)),
                 "an iteration past the first checkpoint")  # fmt: skip
        workers = workers_of(process.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()

        def redoing() -> bool:  # a record that does not follow the one before it
            iterations = [r["iteration"] for r in complete_records(run_dir)]
            return any(b <= a for a, b in itertools.pairwise(iterations))

        wait_for(process, redoing, "the first iteration after the restart")
        restart_s = time.monotonic() - killed_at
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            # torchrun starts its workers in sessions of their own: they go first.
            for pid in workers_of(process.pid).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode == 0, output[-3000:]
    # torchrun started the workers twice: each rank initialized twice.
    assert output.count("torch.distributed initialized") == 4, output[-3000:]
    assert "RNG states not restored" not in output

    written = complete_records(run_dir)
    # The records up to the kill, then those after the restart.
    first = next(i for i in range(1, len(written))
                 if written[i]["iteration"] <= written[i - 1]["iteration"])  # fmt: skip
    before, after = written[:first], written[first:]
    assert [r["iteration"] for r in before] == list(range(1, len(before) + 1))
    resumed_from = after[0]["iteration"] - 1
    assert f"at iteration {resumed_from}" in output, output[-3000:]
    assert [r["iteration"] for r in after] == list(range(resumed_from + 1, ITERATIONS + 1))
    redone = before[-1]["iteration"] - resumed_from
    assert 0 <= redone <= SAVE_INTERVAL, (redone, resumed_from)
    print(
        f"killed rank 1 after iteration {before[-1]['iteration']}; resumed from "
        f"{resumed_from}, {redone} iterations redone; first iteration after the restart "
        f"logged {restart_s:.1f} s after the kill"
    )
    for record in after:
        expected = want[record["iteration"]]
        assert record["consumed_samples"] == expected["consumed_samples"]
        assert record["lm loss"] == expected["lm loss"], record["iteration"]
        assert record["lr"] == expected["lr"] and record["grad_norm"] == expected["grad_norm"]
