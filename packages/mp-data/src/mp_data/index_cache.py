"""A folder of index arrays keyed by what they were built from.

Each entry is named `{md5 of the description}-{name}-` followed by one .npy
file per array (document_index.npy, ... for a GPT dataset) and description.txt.
The description (JSON of every setting that shapes the arrays) is written
last and marks the entry complete; every file is written under a temporary
name and renamed. A changed setting gives another hash, so a stale entry is
never read; it is rebuilt beside the old one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable

import numpy as np

__all__ = ["IndexCache"]


class IndexCache:
    """The entry for one description in `folder`, holding the arrays named `arrays`."""

    def __init__(self, folder: str, name: str, description: dict, arrays: tuple[str, ...]) -> None:
        self.folder = folder
        self.arrays = arrays
        self.description = json.dumps(description, indent=4, sort_keys=True)
        self.hash = hashlib.md5(self.description.encode(), usedforsecurity=False).hexdigest()
        self.base = os.path.join(folder, f"{self.hash}-{name}-")

    def path(self, part: str) -> str:
        return self.base + part

    def exists(self) -> bool:
        return os.path.isfile(self.path("description.txt")) and all(
            os.path.isfile(self.path(f"{a}.npy")) for a in self.arrays
        )

    def load(self) -> dict[str, np.ndarray]:
        """The arrays, memory-mapped. A file that cannot be (a truncated or overwritten
        one) is named, with how to have the entry rebuilt."""
        arrays = {}
        for name in self.arrays:
            path = self.path(f"{name}.npy")
            try:
                arrays[name] = np.load(path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as error:
                raise ValueError(
                    f"{path}: the index cache entry is damaged ({error}); delete its files "
                    f"({self.base}*) and the next run rebuilds them"
                ) from error
        return arrays

    def load_or_build(
        self, build: Callable[[], dict[str, np.ndarray]], may_build: bool
    ) -> dict[str, np.ndarray]:
        """Loads the entry; builds and saves it first when missing and `may_build`."""
        if self.exists():
            return self.load()
        if not may_build:
            raise FileNotFoundError(
                f"{self.path('description.txt')}: index cache entry missing; it is built by "
                "one rank first (BlendedMegatronDatasetBuilder builds on rank 0, then the others)"
            )
        built = build()
        os.makedirs(self.folder, exist_ok=True)
        for name in self.arrays:
            _atomic(self.path(f"{name}.npy"), lambda f, a=built[name]: np.save(f, a))
        _atomic(self.path("description.txt"), lambda f: f.write(self.description.encode()))
        return self.load()


def _atomic(path: str, write: Callable) -> None:
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
