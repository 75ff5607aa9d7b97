"""SIGKILL of every rank at random moments during checkpoint saves: after each kill the
tracked checkpoint is whole, the rerun with the same command resumes from it, and every
iteration's loss, learning rate and gradient norm equal an uninterrupted run's, bit for bit.

One run, killed again and again: each trial starts apps/gpt's pretrain under torchrun
(two ranks, gloo, dropout on so that every rank's generators must come back too), waits
until a save is under way (its iter_N.tmp directory appears), waits a random part of a
save's length, and SIGKILLs both workers and torchrun. The next trial's start is the rerun
of the previous kill; a last start (two forked ranks, the same arguments) runs to the end.
A kill lands either mid-write (the save's .tmp is left behind, the tracker still names the
save before) or just after the commit (the tracker names the new save): the test counts
both.

The fast subset (two trials per case) runs with the suite; the full matrix (20 trials per
case) runs with `uv run pytest tests/faults -m fault_matrix -s` (docs/reliability.md).
"""

import contextlib
import os
import random
import re
import time
from pathlib import Path

import pytest

from mp_ckpt import CheckpointReader, read_tracker
from mp_gpt.testing import complete_records, tiny_options, train_on_rank, train_output_on_rank
from mp_state.testing import TorchrunJob, run_on_ranks

SAVE_INTERVAL = 2
CASES = {
    # Saves in the foreground, two data-parallel ranks.
    "dp2-sync": [],
    # Saves in the background while training goes on, two tensor-parallel ranks.
    "tp2-async": ["--tensor-model-parallel-size", "2", "--async-save"],
}
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def options(run_dir: Path, case: str, iterations: int) -> list[str]:
    return tiny_options(
        run_dir, "--train-iters", str(iterations), "--save-interval", str(SAVE_INTERVAL),
        "--log-interval", "1", "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"),
        *DROPOUT, *CASES[case],
    )  # fmt: skip


def saves_in_progress(ckpt: Path) -> dict[int, int]:
    """The saves being written (their iter_N.tmp directories): {N: the directory's inode}."""
    found = {}
    try:
        entries = list(os.scandir(ckpt))
    except FileNotFoundError:
        return found
    for entry in entries:
        if match := re.fullmatch(r"iter_(\d+)\.tmp", entry.name):
            with contextlib.suppress(FileNotFoundError):
                found[int(match.group(1))] = entry.stat().st_ino
    return found


def wait_for_save(job: TorchrunJob, ckpt: Path, after: int, stale: dict[int, int]) -> int:
    """Waits until this job writes a save of an iteration past `after`; returns it.

    A kill mid-write leaves its iter_N.tmp behind (`stale`) until the rerun saves N again:
    it removes the old directory and makes a new one. The new one is told from the old
    by its inode, or, should the inode be reused, by having seen the old one gone."""

    seen: list[int] = []

    def new_save() -> bool:
        now = saves_in_progress(ckpt)
        for gone in set(stale) - set(now):
            del stale[gone]
        seen.extend(i for i, inode in now.items() if i > after and stale.get(i) != inode)
        return bool(seen)

    job.wait_for(new_save, f"a save past iteration {after}", poll=0.002)
    return max(seen)


def run_trials(tmp_path: Path, case: str, trials: int, seed: int) -> None:
    iterations = SAVE_INTERVAL * (2 * trials + 2)
    reference = tmp_path / "reference"
    run_on_ranks(train_on_rank, 2, options(reference, case, iterations), timeout=300)
    want = {r["iteration"]: r for r in complete_records(reference)}
    assert sorted(want) == list(range(1, iterations + 1))

    run_dir = tmp_path / "killed"
    ckpt = run_dir / "ckpt"
    target = ["-m", "mp_gpt.pretrain", *options(run_dir, case, iterations)]
    chance = random.Random(seed)
    landed = {"mid-write": 0, "after the commit": 0}
    left_tracked = []
    for trial in range(trials):
        tracked, stale = read_tracker(ckpt) or 0, saves_in_progress(ckpt)
        with TorchrunJob(target, run_dir) as job:
            # A save past the one this start resumed from: how long it takes (its .tmp
            # directory's life), then the next save, killed a random part of that into it.
            first = wait_for_save(job, ckpt, tracked, stale)
            length = job.wait_for(
                lambda: first not in saves_in_progress(ckpt),  # noqa: B023
                f"the end of the save of iteration {first}",
                poll=0.002,
            )
            saving = wait_for_save(job, ckpt, first, stale)
            # The first trial kills at once (mid-write for sure); the others within one
            # and a half of a save's length.
            delay = 0.0 if trial == 0 else chance.uniform(0, 1.5 * length)
            time.sleep(delay)
            job.kill()
        now = read_tracker(ckpt)
        assert now is not None and now >= tracked, (tracked, now)
        landed["mid-write" if now < saving else "after the commit"] += 1
        left_tracked.append(now)
        # Whatever the tracker names is whole: every file matches its recorded digest.
        assert CheckpointReader(ckpt).verify() == [], f"trial {trial}: iteration {now}"
        print(f"trial {trial}: a save took {length * 1000:.0f} ms; killed "
              f"{delay * 1000:.0f} ms into the save of iteration {saving}; the tracker names "
              f"{now}")  # fmt: skip

    # The last start runs to the end on two forked ranks with the same arguments (as the
    # reference: no kill is coming, a torchrun start-up would only cost time).
    argv = options(run_dir, case, iterations)
    last = run_on_ranks(train_output_on_rank, 2, argv, timeout=300)
    assert [status for status, _ in last] == [0, 0], last[0][1][-4000:]
    output = (run_dir / "output.log").read_text(errors="replace") + last[0][1] + last[1][1]
    assert "RNG states not restored" not in output

    # Every start but the first resumed from the checkpoint the kill before left tracked.
    resumed = [int(i) for i in re.findall(r"\[rank 0\] .* loaded \S+ \(iteration (\d+)\)", output)]
    assert resumed == left_tracked, (resumed, left_tracked)
    # Every iteration written, before a kill or after a resume, is the reference's.
    records = complete_records(run_dir)
    assert {r["iteration"] for r in records} == set(want)
    for record in records:
        expected = want[record["iteration"]]
        where = f"iteration {record['iteration']}"
        assert record["consumed_samples"] == expected["consumed_samples"], where
        assert record["lm loss"] == expected["lm loss"], where
        assert record["lr"] == expected["lr"], where
        assert record["grad_norm"] == expected["grad_norm"], where
    redone = len(records) - iterations
    print(f"figure: kill-during-save {case}: {trials} trials (seed {seed}): "
          f"{landed['mid-write']} mid-write, {landed['after the commit']} after the commit; "
          f"all resumed bitwise; {redone} iterations redone in all")  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_kills_during_saves_fast(tmp_path, case):
    run_trials(tmp_path, case, trials=2, seed=0)


@pytest.mark.multirank
@pytest.mark.fault_matrix
@pytest.mark.parametrize("case", sorted(CASES))
def test_kills_during_saves_full_matrix(tmp_path, case):
    run_trials(tmp_path, case, trials=20, seed=random.SystemRandom().randrange(1 << 30))
