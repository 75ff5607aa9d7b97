"""The commit protocol: an async save is invisible until committed and equals a sync save;
a save killed mid-write leaves the previous checkpoint in place and loadable."""

import errno
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import mp_ckpt.core.checkpointer as checkpointer_module
from mp_ckpt import (
    Checkpointer,
    CheckpointSaveError,
    ShardedTensor,
    checkpoint_dir,
    load_checkpoint,
    read_tracker,
)


def pieces(scale: float) -> dict:
    w = torch.arange(12.0).view(3, 4) * scale
    return {"w": ShardedTensor("w", w, (3, 4), (0, 0))}


def loaded(root) -> torch.Tensor:
    target = {"w": ShardedTensor("w", torch.zeros(3, 4), (3, 4), (0, 0))}
    load_checkpoint(root, target)
    return target["w"].data


def hold_writes(monkeypatch) -> tuple[threading.Event, object]:
    """DCP's save writes, then waits for the returned event (the real save is returned too)."""
    release = threading.Event()
    real_save = checkpointer_module.dcp.save

    def held_save(*args, **kwargs):
        real_save(*args, **kwargs)
        assert release.wait(30)

    monkeypatch.setattr(checkpointer_module.dcp, "save", held_save)
    return release, real_save


def test_async_save_is_invisible_until_committed_and_equals_a_sync_save(tmp_path, monkeypatch):
    release, real_save = hold_writes(monkeypatch)
    checkpointer = Checkpointer(tmp_path / "async", async_save=True)
    data = pieces(2.0)
    checkpointer.save(4, data)
    data["w"].data.fill_(-1.0)  # the training loop moves on: the staged copy was taken
    time.sleep(0.2)
    assert read_tracker(tmp_path / "async") is None
    assert not checkpoint_dir(tmp_path / "async", 4).exists()
    release.set()
    checkpointer.finalize()
    assert read_tracker(tmp_path / "async") == 4

    monkeypatch.setattr(checkpointer_module.dcp, "save", real_save)
    Checkpointer(tmp_path / "sync").save(4, pieces(2.0))
    torch.testing.assert_close(loaded(tmp_path / "async"), loaded(tmp_path / "sync"), rtol=0,
                               atol=0)  # fmt: skip


def test_a_failed_async_save_surfaces_at_the_next_call(tmp_path, monkeypatch):
    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointer_module.dcp, "save", failing_save)
    checkpointer = Checkpointer(tmp_path, async_save=True)
    checkpointer.save(1, pieces(1.0))
    with pytest.raises(RuntimeError, match="asynchronous checkpoint save failed"):
        checkpointer.finalize()
    assert read_tracker(tmp_path) is None


def test_a_full_disk_is_named_and_the_partial_save_removed(tmp_path, monkeypatch):
    Checkpointer(tmp_path).save(1, pieces(1.0))

    def full_disk(*args, **kwargs):
        (tmp_path / "iter_0000002.tmp" / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer_module.dcp, "save", full_disk)
    with pytest.raises(CheckpointSaveError) as failed:
        Checkpointer(tmp_path).save(2, pieces(2.0))
    message = str(failed.value)
    assert message.startswith(f"saving iteration 2 into {tmp_path / 'iter_0000002.tmp'} failed: ")
    assert "No space left on device; the file system is full (" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "latest_checkpointed_iteration.txt"]  # fmt: skip
    assert read_tracker(tmp_path) == 1


def save_then_wait_before_the_commit(root: str, marker: Path) -> None:
    """In a forked process: saves iteration 1, then writes iteration 2's pieces, says so
    in `marker` and waits (to be killed) before the commit."""
    torch.set_num_threads(1)  # a forked child cannot use the parent's OpenMP threads
    checkpointer = Checkpointer(root)
    checkpointer.save(1, pieces(1.0))
    real_save = checkpointer_module.dcp.save

    def slow_save(*args, **kwargs):
        real_save(*args, **kwargs)  # the pieces of iteration 2 are on disk ...
        marker.write_text("writing")
        time.sleep(60)  # ... and the process dies before the commit

    checkpointer_module.dcp.save = slow_save
    checkpointer.save(2, pieces(2.0))


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    marker = tmp_path / "marker"
    # Forked: a new interpreter would spend seconds importing torch.
    process = multiprocessing.get_context("fork").Process(
        target=save_then_wait_before_the_commit, args=(str(tmp_path / "ckpt"), marker)
    )
    process.start()
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert process.is_alive(), "the saving process exited early"
            assert time.monotonic() < deadline, "the saving process never reached iteration 2"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
    finally:
        if process.is_alive():
            process.kill()
            process.join()
    root = tmp_path / "ckpt"
    assert read_tracker(root) == 1
    assert (root / "iter_0000002.tmp").exists() and not checkpoint_dir(root, 2).exists()
    torch.testing.assert_close(loaded(root), torch.arange(12.0).view(3, 4), rtol=0, atol=0)
    # The next save of iteration 2 replaces the leftover directory.
    Checkpointer(root).save(2, pieces(2.0))
    assert read_tracker(root) == 2 and not (root / "iter_0000002.tmp").exists()


def test_async_save_keeps_the_plain_state_as_it_was_at_save(tmp_path, monkeypatch):
    release, real_save = hold_writes(monkeypatch)
    checkpointer = Checkpointer(tmp_path, async_save=True)
    common = {"step": 1}
    checkpointer.save(1, pieces(1.0), common=common)
    common["step"] = 2  # the loop goes on while the thread writes
    release.set()
    checkpointer.finalize()
    assert torch.load(checkpoint_dir(tmp_path, 1) / "common.pt")["step"] == 1
    # A second save of the same iteration replaces the first (set aside, then removed).
    monkeypatch.setattr(checkpointer_module.dcp, "save", real_save)
    Checkpointer(tmp_path).save(1, pieces(3.0))
    torch.testing.assert_close(loaded(tmp_path), torch.arange(12.0).view(3, 4) * 3, rtol=0, atol=0)
    assert not (tmp_path / "iter_0000001.old").exists()
