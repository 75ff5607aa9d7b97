"""Checksums of a checkpoint's files: recorded at save, verified at load."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["CHECKSUMS", "CheckpointCorrupted", "file_digest", "verify_files"]

CHECKSUMS = "checksums.json"
_BLOCK = 8 << 20


class CheckpointCorrupted(RuntimeError):
    """A checkpoint file is missing, or its size or sha256 differs from the recorded one."""


def file_digest(path: Path) -> dict:
    """{"sha256": hex digest, "bytes": size} of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return {"sha256": digest.hexdigest(), "bytes": size}


def recorded_files(directory: Path) -> dict[str, dict]:
    """The checksums.json of a checkpoint directory."""
    path = directory / CHECKSUMS
    if not path.exists():
        raise CheckpointCorrupted(f"{path} is missing: the checkpoint is incomplete")
    return json.loads(path.read_text())


def verify_files(directory: Path, names: list[str], recorded: dict[str, dict]) -> list[str]:
    """Problems with `names` (each naming the file); empty when all match."""
    problems = []
    for name in names:
        path = directory / name
        want = recorded[name]
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, {want['bytes']} recorded")
            continue
        if file_digest(path)["sha256"] != want["sha256"]:
            problems.append(f"{path}: sha256 differs from the one recorded at save")
    return problems
