"""IndexedDataset: a memory-mapped reader of Megatron's .bin/.idx files.

Opening a prefix maps both files and checks that they agree; nothing is read
until asked for. Sequence i is `dataset[i]` (a numpy view of the mapped .bin,
O(1)), a part of it is `dataset.get(i, offset, length)`, and a slice
`dataset[a:b]` returns the sequences a..b-1 from one contiguous read.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np

from mp_data.indexed_format import (
    HEADER_SIZE,
    get_bin_path,
    get_idx_path,
    read_header,
)

__all__ = ["IndexedDataset"]


class IndexedDataset:
    """Sequences of tokens from P.bin, described by P.idx (Megatron's MMIDIDX).

    `multimodal=True` also reads the per-sequence modes that multimodal
    datasets append to the index.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such file (dataset prefix {path_prefix!r})")
        self._idx = _map(idx_path)
        header = read_header(self._idx, idx_path)
        self.dtype = header.dtype
        s, d = header.sequence_count, header.document_count
        size, expected = len(self._idx), HEADER_SIZE + header.body_size
        if size not in (expected, expected + s):
            raise ValueError(
                f"{idx_path}: {size} bytes, but a header for {s} sequences and {d - 1} "
                f"documents needs {expected} (or {expected + s} with sequence modes): "
                "the index is truncated or corrupt"
            )
        if multimodal and size != expected + s:
            raise ValueError(f"{idx_path}: multimodal=True, but the index has no sequence modes")
        buffer = memoryview(self._idx) if len(self._idx) else b""
        self.sequence_lengths = np.frombuffer(buffer, np.int32, s, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buffer, np.int64, s, HEADER_SIZE + 4 * s)
        self.document_indices = np.frombuffer(buffer, np.int64, d, HEADER_SIZE + 12 * s)
        self.sequence_modes = np.frombuffer(buffer, np.int8, s, expected) if multimodal else None
        self._check_index(idx_path)
        self._bin = _map(bin_path)
        self._check_bin(bin_path)
        self._tokens = np.frombuffer(memoryview(self._bin) if len(self._bin) else b"", self.dtype)

    def _check_index(self, path: str) -> None:
        # Cheap checks only (no temporaries the size of the index): opening a
        # 100M-sequence dataset must stay instant.
        docs, s = self.document_indices, len(self.sequence_lengths)
        # Megatron's builder ends the list at S once the last document is ended;
        # a writer that never ended one leaves it shorter, which stays readable.
        if docs[0] != 0 or docs[-1] > s:
            raise ValueError(
                f"{path}: document indices must run from 0 to at most the sequence count "
                f"{s}; they run from {docs[0]} to {docs[-1]}"
            )
        if not s:
            return
        itemsize = self.dtype.itemsize
        total = int(self.sequence_lengths.sum(dtype=np.int64))
        before_last = total - int(self.sequence_lengths[-1])
        if self.sequence_pointers[0] != 0 or self.sequence_pointers[-1] != before_last * itemsize:
            raise ValueError(
                f"{path}: sequence pointers ({self.sequence_pointers[0]} ... "
                f"{self.sequence_pointers[-1]}) disagree with the sequence lengths "
                f"(0 ... {before_last * itemsize})"
            )

    def _check_bin(self, path: str) -> None:
        s = len(self.sequence_lengths)
        need = 0
        if s:
            last = int(self.sequence_lengths[-1]) * self.dtype.itemsize
            need = int(self.sequence_pointers[-1]) + last
        if len(self._bin) != need:
            what = "truncated" if len(self._bin) < need else "longer than its index"
            raise ValueError(
                f"{path}: {len(self._bin)} bytes, but {get_idx_path(self.path_prefix)} "
                f"describes {need} bytes of {self.dtype.name} tokens: the .bin is {what}"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices must be contiguous, got step {step}")
            if start >= stop:
                return []
            first = self._offset(start)
            lengths = self.sequence_lengths[start:stop]
            block = self._tokens[first : first + int(lengths.sum())]
            return np.split(block, np.cumsum(lengths)[:-1])
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset+length of sequence idx (to its end without a length)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} is out of range for {n} sequences")
        idx %= n
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens {offset}..{offset + length} are outside sequence {idx} of {size} tokens"
            )
        start = self._offset(idx) + offset
        return self._tokens[start : start + length]

    def _offset(self, idx: int) -> int:
        return int(self.sequence_pointers[idx]) // self.dtype.itemsize

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.get(i)

    @property
    def document_count(self) -> int:
        return len(self.document_indices) - 1

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Both P.idx and P.bin exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(
            get_bin_path(path_prefix)
        )

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}: {len(self)} sequences, "
            f"{self.document_count} documents, {self.dtype.name})"
        )


def _map(path: str) -> mmap.mmap | bytes:
    """The file read-only in memory (an empty file cannot be mapped: b"")."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
