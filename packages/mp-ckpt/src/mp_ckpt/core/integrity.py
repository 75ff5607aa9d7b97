"""Checksums of a checkpoint's files: recorded at save, verified at load."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = [
    "CHECKSUMS",
    "CheckpointCorrupted",
    "HashingFileSystemWriter",
    "file_digest",
    "verify_files",
]

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


class HashingFile:
    """A binary file open for writing that hashes every byte written through it, so a
    checksum costs no second read of the file."""

    def __init__(self, file) -> None:
        self._file = file
        self._digest = hashlib.sha256()
        self._bytes = 0

    def write(self, data) -> int:
        written = self._file.write(data)
        view = memoryview(data).cast("B")
        if written is not None and written != len(view):
            raise OSError(f"{self._file.name}: short write ({written} of {len(view)} bytes)")
        self._digest.update(view)  # releases the GIL for large blocks
        self._bytes += len(view)
        return len(view)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()

    def result(self) -> dict:
        """What file_digest would return for the file written."""
        return {"sha256": self._digest.hexdigest(), "bytes": self._bytes}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing the data files (*.distcp) as they are written."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP writes from several threads

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with path.open("wb") as file:
            stream = HashingFile(file)
            yield stream
        with self._lock:
            self.digests[path.name] = stream.result()


class HashingFileSystemWriter(dcp.FileSystemWriter):
    """dcp.FileSystemWriter that records the sha256 and size of every data file it
    writes in `digests` ({file name: file_digest(...)}), computed while writing."""

    def __init__(self, path: str | os.PathLike, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    @property
    def digests(self) -> dict[str, dict]:
        return self.fs.digests

    def digest(self, path: Path) -> dict:
        """The digest of a file in the checkpoint: recorded while writing when this
        writer wrote it, read back otherwise."""
        recorded = self.fs.digests.get(path.name)
        return recorded if recorded is not None else file_digest(path)


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
