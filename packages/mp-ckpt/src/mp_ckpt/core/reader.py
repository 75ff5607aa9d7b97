"""Reading logical tensors from a checkpoint in one process, a region at a time.

The offline tools (inspect, convert, Hugging Face export) use this. A region
covered by whole saved boxes is read box by box straight into its place
(DCP reads only the shared part of each stored tensor); flattened ranges are
read whole and copied. Memory therefore stays near the region asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mp_ckpt.core.box_reads import KeptMetadataReader, read_boxes, stored_buffer
from mp_ckpt.core.integrity import recorded_files, verify_files
from mp_ckpt.core.loader import read_metadata, resolve
from mp_ckpt.core.regions import Region, copy_shared, local_box

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """A checkpoint directory (a root with a tracker, or one iter_XXXXXXX directory)."""

    def __init__(self, path: str | os.PathLike, *, iteration: int | None = None) -> None:
        path = Path(path)
        if (path / "mp_metadata.json").exists() and iteration is None:
            self.directory = path
        else:
            _, self.directory = resolve(path, iteration)
        self.metadata = read_metadata(self.directory)
        self._storage = KeptMetadataReader(self.directory)  # DCP's .metadata, parsed once
        self.chunks: dict[str, list[dict]] = {}
        for chunk in self.metadata["chunks"]:
            self.chunks.setdefault(chunk["key"], []).append(chunk)

    @property
    def iteration(self) -> int:
        return self.metadata["iteration"]

    @property
    def keys(self) -> list[str]:
        return list(self.metadata["tensors"])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return getattr(torch, self._entry(key)["dtype"])

    def verify(self) -> list[str]:
        """Problems found by checking every file against checksums.json."""
        recorded = recorded_files(self.directory)
        return verify_files(self.directory, sorted(recorded), recorded)

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        """The region (default: the whole tensor) of logical tensor `key`."""
        shape = self.shape(key)
        if region is None:
            region = Region((0,) * len(shape), shape)
        out_shape = (
            (region.flattened_range[1] - region.flattened_range[0],)
            if region.flattened_range
            else region.shape
        )
        out = torch.empty(out_shape, dtype=self.dtype(key))
        copied = 0
        boxes: dict[str, list] = {}  # read together, in one load
        for chunk in self.chunks[key]:
            source = Region.from_chunk(chunk)
            shared = source.box_overlap(region)
            if shared is None:
                continue
            if source.flattened_range is None and region.flattened_range is None:
                # Only the shared box is read, straight into its place in `out`.
                target = out[local_box(shared, region)]
                boxes.setdefault(chunk["storage_key"], []).append(
                    (local_box(shared, source), target)
                )
                copied += target.numel()
                continue
            data = self._load_chunk(chunk)
            copied += copy_shared(data, source, out, region)
            del data
        if boxes:
            read_boxes(self.directory, boxes, distributed=False, storage_reader=self._storage)
        if copied != out.numel():
            raise ValueError(
                f"{self.directory}: {key}: the saved pieces cover {copied} of {out.numel()} "
                "elements asked for"
            )
        return out

    def _entry(self, key: str) -> dict:
        try:
            return self.metadata["tensors"][key]
        except KeyError:
            raise KeyError(f"{self.directory} has no tensor {key!r}") from None

    def _load_chunk(self, chunk: dict) -> torch.Tensor:
        buffer, whole = stored_buffer(chunk)
        read_boxes(self.directory, {chunk["storage_key"]: [(whole, buffer)]}, distributed=False,
                   storage_reader=self._storage)  # fmt: skip
        return buffer
