"""Megatron's checkpoint directory layout and the atomic tracker.

    <save>/latest_checkpointed_iteration.txt     the iteration of the last complete save
    <save>/iter_0000100/                         one checkpoint
        __0_0.distcp, __1_0.distcp, ...          each rank's pieces (torch.distributed.checkpoint)
        .metadata                                DCP's index of them
        mp_metadata.json                         logical tensors, saved pieces, layout (readable)
        common.pt                                rank 0's plain state (iteration, config, ...)
        rank_00000.pt, ...                       per-rank state (RNG)
        checksums.json                           sha256 and size of every file above

A save writes into iter_XXXXXXX.tmp/ and is renamed once every rank has
finished; the tracker is then replaced atomically. A checkpoint is therefore
either complete and named by the tracker, or invisible.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = [
    "TRACKER",
    "checkpoint_dir",
    "fsync_dir",
    "list_iterations",
    "read_tracker",
    "remove_old_checkpoints",
    "write_tracker",
]

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def checkpoint_dir(root: str | os.PathLike, iteration: int) -> Path:
    """<root>/iter_0000100 (Megatron's seven-digit name)."""
    if iteration < 0:
        raise ValueError(f"iteration={iteration} must be >= 0")
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | os.PathLike) -> int | None:
    """The iteration named by the tracker, or None when there is no tracker."""
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if text == "release":
        raise ValueError(f"{path}: 'release' checkpoints are not supported; convert it first")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from None


def write_tracker(root: str | os.PathLike, iteration: int) -> None:
    """Points the tracker at `iteration`, atomically (a temporary file renamed over it)."""
    path = Path(root) / TRACKER
    tmp = path.with_name(f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def list_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations with a complete checkpoint directory under root, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _ITER_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def remove_old_checkpoints(root: str | os.PathLike, keep_last: int | None,
                           retain_interval: int | None = None) -> list[int]:  # fmt: skip
    """Deletes all but the newest keep_last checkpoints (None: the newest one, when a
    retain_interval is given; else nothing), never the tracker's nor those whose iteration
    is a multiple of retain_interval; returns the iterations deleted."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    if keep_last is None and retain_interval is None:
        return []
    current = read_tracker(root)
    iterations = list_iterations(root)
    newest = iterations[-(keep_last or 1) :]
    doomed = [i for i in iterations if i not in newest and i != current
              and not (retain_interval and i % retain_interval == 0)]  # fmt: skip
    for iteration in doomed:
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)
    return doomed


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries durable (renames and new files in it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
