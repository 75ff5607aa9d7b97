"""Checkpoints that cannot be used, and a save that cannot be written: the run stops with
an error naming the file or the field at fault and what to do, and nothing committed is
lost.

- A corrupted shard, or a missing file, in the tracked checkpoint: the error names the
  file and the earlier checkpoints; resuming from the newest of those (--ckpt-step)
  trains on to the end.
- A checkpoint of another model shape: every differing field is named.
- A full disk during a save (a small tmpfs; skipped where this process may not mount
  one): the error says the file system is full, the partial save is removed, the tracker
  names the checkpoint before, which is whole; with room again, the run resumes from it.

Two forked ranks (gloo) run apps/gpt's pretrain, the tiny config on mock data.
"""

import contextlib
import subprocess
from pathlib import Path

import pytest

from mp_ckpt import CheckpointReader, checkpoint_dir, read_tracker
from mp_gpt.testing import complete_records, tiny_options, train_on_rank
from mp_state.testing import RankFailure, run_on_ranks


def options(run_dir: Path, iterations: int, *extra: str) -> list[str]:
    ckpt = str(run_dir / "ckpt")
    return tiny_options(run_dir, "--train-iters", str(iterations), "--save-interval", "2",
                        "--save", ckpt, "--load", ckpt, *extra)  # fmt: skip


def failure(run_dir: Path, iterations: int, *extra: str) -> str:
    """What the ranks' failure says, when a run of `options` fails."""
    with pytest.raises(RankFailure) as raised:
        run_on_ranks(train_on_rank, 2, options(run_dir, iterations, *extra), timeout=180)
    return str(raised.value)


def flip_a_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.multirank
@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_a_damaged_checkpoint_is_named_and_an_earlier_one_resumes(tmp_path, damage):
    # Eight iterations planned, the job stopped after four (--exit-interval).
    assert run_on_ranks(train_on_rank, 2, options(tmp_path, 8, "--exit-interval", "4"),
                        timeout=180) == [0, 0]  # fmt: skip
    latest = checkpoint_dir(tmp_path / "ckpt", 4)
    if damage == "flipped byte":
        victim = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        flip_a_byte(victim, victim.stat().st_size // 2)
        said = f"{victim}: sha256 differs from the one recorded at save"
    else:
        victim = latest / "common.pt"
        victim.unlink()
        said = f"{victim}: missing"
    message = failure(tmp_path, 8)
    assert f"{latest} failed its integrity check: {said}" in message, message
    assert "resume from the newest with --ckpt-step 2" in message, message
    # What the error advises: the run goes on from iteration 2 to the end, and its save
    # of iteration 4 replaces the damaged one.
    assert run_on_ranks(train_on_rank, 2, options(tmp_path, 8, "--ckpt-step", "2"),
                        timeout=180) == [0, 0]  # fmt: skip
    assert read_tracker(tmp_path / "ckpt") == 8
    assert CheckpointReader(tmp_path / "ckpt", iteration=4).verify() == []
    assert [r["iteration"] for r in complete_records(tmp_path)][-6:] == [3, 4, 5, 6, 7, 8]


@pytest.mark.multirank
def test_another_model_shape_is_refused_naming_the_fields(tmp_path):
    assert run_on_ranks(train_on_rank, 2, options(tmp_path, 2), timeout=180) == [0, 0]
    message = failure(tmp_path, 4, "--hidden-size", "64", "--num-layers", "2")
    assert "cannot be resharded" in message
    assert "num_layers: checkpoint 4, this run 2" in message
    assert "hidden_size: checkpoint 128, this run 64" in message


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.multirank
def test_a_full_disk_fails_the_save_and_keeps_the_checkpoint_before(tmp_path):
    # One checkpoint of the tiny model (10.6 MB on two ranks) fits in 16 MB, two do not.
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        with pytest.raises(RankFailure) as raised:
            run_on_ranks(train_on_rank, 2, options(disk, 6), timeout=180)
        ckpt = disk / "ckpt"
        # Rank 0's own write failed: it says why; rank 1 names rank 0.
        said = raised.value.failures
        assert "saving iteration 4 into" in said[0] and "the file system is full" in said[0], said
        assert "checkpoint failed on rank 0" in said[1], said
        assert read_tracker(ckpt) == 2
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000002",
            "latest_checkpointed_iteration.txt",
        ]  # the partial save is gone
        assert CheckpointReader(ckpt).verify() == []
        # With room again, the same command resumes from iteration 2.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert run_on_ranks(train_on_rank, 2, options(disk, 6), timeout=180) == [0, 0]
        assert read_tracker(ckpt) == 6
        records = complete_records(disk)
        assert [r["iteration"] for r in records] == [1, 2, 3, 4, 3, 4, 5, 6]
