"""IndexedDatasetBuilder: writes Megatron's .bin/.idx, visible only when complete.

Tokens stream into a hidden temporary file beside the target .bin; finalize()
writes the index the same way and only then renames both into place (.bin
first, then .idx). A run that fails or is killed leaves no P.bin / P.idx,
only hidden temporaries, so a reader never sees half a dataset.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np

from mp_data.indexed_dataset import IndexedDataset
from mp_data.indexed_format import IndexHeader, get_bin_path, get_idx_path
from mp_data.progress import progress as progress_reporter

__all__ = ["IndexedDatasetBuilder", "merge_datasets"]


class IndexedDatasetBuilder:
    """Appends sequences and documents; `finalize(idx_path)` publishes the dataset.

    Megatron's interface: add_item (one sequence), end_document, add_document
    (a document of several sequences), add_index (append another dataset).
    Usable as a context manager: leaving the block by an exception discards
    the temporary files.
    """

    def __init__(self, bin_path: str, dtype: type | np.dtype = np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        IndexHeader(self.dtype, 0, 1).pack()  # fails early on a dtype without a code
        self._bin_tmp = _temporary_beside(bin_path)
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed by finalize/discard)
        self._lengths: list[int] = []
        self._document_indices: list[int] = [0]
        self._extra_lengths: list[np.ndarray] = []  # whole indices appended by add_index
        self._done = False

    @property
    def sequence_count(self) -> int:
        return len(self._lengths) + sum(len(a) for a in self._extra_lengths)

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Appends one sequence."""
        array = self._as_tokens(tokens)
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(array.size)

    def end_document(self) -> None:
        """Closes the current document after the sequences added since the last one."""
        self._document_indices.append(self.sequence_count)

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int]) -> None:
        """Appends one document: `tokens` split into sequences of `lengths`."""
        array = self._as_tokens(tokens)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != array.size or any(n < 0 for n in lengths):
            raise ValueError(
                f"lengths {lengths[:8]}{'...' if len(lengths) > 8 else ''} do not split "
                f"a document of {array.size} tokens"
            )
        self._bin.write(array.tobytes(order="C"))
        self._lengths.extend(lengths)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Appends every sequence and document of the dataset at `path_prefix`."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"{path_prefix}: tokens are {other.dtype.name}, this dataset's are "
                f"{self.dtype.name}; merged datasets must share a dtype"
            )
        offset = self.sequence_count
        self._flush_lengths()
        self._extra_lengths.append(np.array(other.sequence_lengths, dtype=np.int32))
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._bin, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Writes the index, then moves .bin and .idx into place."""
        if self._done:
            raise RuntimeError(f"{self.bin_path}: finalize() was already called")
        try:
            self._flush_lengths()
            lengths = (
                np.concatenate(self._extra_lengths) if self._extra_lengths
                else np.zeros(0, np.int32)
            )  # fmt: skip
            # As Megatron: exactly the boundaries given. Sequences added after the
            # last end_document() belong to no document (preprocessing always ends one).
            docs = np.array(self._document_indices, dtype=np.int64)
            pointers = np.zeros(len(lengths), np.int64)
            np.cumsum(lengths[:-1] * np.int64(self.dtype.itemsize), out=pointers[1:])
            self._bin.close()
            idx_tmp = _temporary_beside(idx_path)
            try:
                with open(idx_tmp, "wb") as f:
                    f.write(IndexHeader(self.dtype, len(lengths), len(docs)).pack())
                    f.write(lengths.astype("<i4", copy=False).tobytes())
                    f.write(pointers.astype("<i8", copy=False).tobytes())
                    f.write(docs.astype("<i8", copy=False).tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(self._bin_tmp, self.bin_path)
                os.replace(idx_tmp, idx_path)
            finally:
                if os.path.exists(idx_tmp):
                    os.unlink(idx_tmp)
        except BaseException:
            self.discard()
            raise
        self._done = True

    def discard(self) -> None:
        """Drops everything written so far; nothing appears at the target paths."""
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.unlink(self._bin_tmp)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.discard()

    def _flush_lengths(self) -> None:
        if self._lengths:
            self._extra_lengths.append(np.array(self._lengths, dtype=np.int32))
            self._lengths = []

    def _as_tokens(self, tokens) -> np.ndarray:
        if self._done:
            raise RuntimeError(f"{self.bin_path}: the builder is finalized or discarded")
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {tuple(array.shape)}")
        if array.size and array.dtype != self.dtype:
            if self.dtype.kind in "iu":
                if array.dtype.kind not in "iu":
                    raise ValueError(f"tokens of dtype {array.dtype} are not integers")
                info = np.iinfo(self.dtype)
                low, high = int(array.min()), int(array.max())
                if low < info.min or high > info.max:
                    bad = low if low < info.min else high
                    raise ValueError(
                        f"token id {bad} does not fit the dataset's {self.dtype.name} "
                        f"({info.min}..{info.max})"
                    )
            array = array.astype(self.dtype)
        return array.astype(self.dtype, copy=False)


def merge_datasets(prefixes: Sequence[str], output_prefix: str, *,
                   progress: bool = False) -> IndexedDataset:  # fmt: skip
    """Concatenates the datasets at `prefixes`, in order, into `output_prefix`.
    progress: report the datasets appended on stderr (mp_data.progress)."""
    if not prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    first = IndexedDataset(prefixes[0])
    with (
        IndexedDatasetBuilder(get_bin_path(output_prefix), first.dtype) as builder,
        progress_reporter(len(prefixes), "merge", unit="dataset", enabled=progress) as bar,
    ):
        for prefix in prefixes:
            builder.add_index(prefix)
            bar.update()
        builder.finalize(get_idx_path(output_prefix))
    return IndexedDataset(output_prefix)


def _temporary_beside(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    return tmp
