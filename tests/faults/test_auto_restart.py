"""A rank killed mid-run under `torchrun --max-restarts 1`: torchrun restarts the workers,
they resume from the latest complete checkpoint with the unchanged command, redo at
most save_interval iterations, finish with exit 0, and the losses after the restart are
the uninterrupted run's, bit for bit; with checkpoints saved in the foreground and in
the background (--async-save).

The killed run goes under torchrun as a user would launch it; the uninterrupted run it
is compared with goes on two forked ranks (the same code and settings, spared a
torchrun start-up).
"""

import itertools
import os
import signal
import time
from pathlib import Path

import pytest

from mp_ckpt import read_tracker
from mp_gpt.testing import complete_records, tiny_options, train_on_rank
from mp_state.testing import TorchrunJob, run_on_ranks

ITERATIONS = 16
SAVE_INTERVAL = 4


SAVING = {"sync": [], "async": ["--async-save"]}


def options(run_dir: Path, saving: str) -> list[str]:
    return tiny_options(
        run_dir, "--train-iters", str(ITERATIONS), "--save-interval", str(SAVE_INTERVAL),
        "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), *SAVING[saving],
    )  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("saving", sorted(SAVING))
def test_killed_rank_restarts_and_resumes_bitwise(tmp_path, saving):
    reference = tmp_path / "reference"
    run_on_ranks(train_on_rank, 2, options(reference, saving), timeout=240)
    want = {r["iteration"]: r for r in complete_records(reference)}
    assert sorted(want) == list(range(1, ITERATIONS + 1))

    run_dir = tmp_path / "restarted"
    target = ["-m", "mp_gpt.pretrain", *options(run_dir, saving)]
    with TorchrunJob(target, run_dir, launcher_args=("--max-restarts", "1")) as job:
        # Past the first save: an iteration after it is logged.
        job.wait_for(lambda: (read_tracker(run_dir / "ckpt") or 0) >= SAVE_INTERVAL
                     and any(r["iteration"] > SAVE_INTERVAL for r in complete_records(run_dir)),
                     "an iteration past the first checkpoint")  # fmt: skip
        workers = job.workers()
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()

        def redoing() -> bool:  # a record that does not follow the one before it
            iterations = [r["iteration"] for r in complete_records(run_dir)]
            return any(b <= a for a, b in itertools.pairwise(iterations))

        job.wait_for(redoing, "the first iteration after the restart")
        restart_s = time.monotonic() - killed_at
        job.wait(timeout=240)
    output = job.output()
    assert job.returncode == 0, output[-3000:]
    # torchrun started the workers twice: each rank initialized twice.
    assert output.count("torch.distributed initialized") == 4, output[-3000:]
    assert "RNG states not restored" not in output
    # torchrun's logs of both attempts in the run's folder (by default, a folder of /tmp
    # that it leaves)
    assert sorted(p.name for p in (run_dir / "torchrun-logs").glob("*/attempt_*")) == [
        "attempt_0",
        "attempt_1",
    ]

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
        f"figure: auto-restart {saving}: killed rank 1 after iteration "
        f"{before[-1]['iteration']}; resumed from "
        f"{resumed_from}, {redone} iterations redone; first iteration after the restart "
        f"logged {restart_s:.1f} s after the kill"
    )
    for record in after:
        expected = want[record["iteration"]]
        assert record["consumed_samples"] == expected["consumed_samples"]
        assert record["lm loss"] == expected["lm loss"], record["iteration"]
        assert record["lr"] == expected["lr"] and record["grad_norm"] == expected["grad_norm"]
