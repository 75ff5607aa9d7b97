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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mp_ckpt.checkpointer import single_process_quiet
from mp_ckpt.integrity import recorded_files, verify_files
from mp_ckpt.loader import read_metadata, resolve
from mp_ckpt.regions import Region, copy_shared

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
        for chunk in self.chunks[key]:
            source = Region.from_chunk(chunk)
            shared = source.box_overlap(region)
            if shared is None:
                continue
            if source.flattened_range is None and region.flattened_range is None:
                # Only the shared box is read, straight into its place in `out`.
                target = out[_local(shared, region)]
                self._load_box(chunk, _local(shared, source), target)
                copied += target.numel()
                continue
            data = self._load_chunk(chunk)
            copied += copy_shared(data, source, out, region)
            del data
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

    def _load_box(self, chunk: dict, box: tuple[slice, ...], target: torch.Tensor) -> None:
        planner = _BoxLoadPlanner(chunk["storage_key"], box)
        with single_process_quiet():
            dcp.load({chunk["storage_key"]: target}, planner=planner, no_dist=True,
                     storage_reader=dcp.FileSystemReader(self.directory))  # fmt: skip

    def _load_chunk(self, chunk: dict) -> torch.Tensor:
        flat = chunk["flattened_range"]
        shape = (flat[1] - flat[0],) if flat else tuple(chunk["shape"])
        buffer = {chunk["storage_key"]: torch.empty(shape, dtype=getattr(torch, chunk["dtype"]))}
        with single_process_quiet():
            dcp.load(buffer, storage_reader=dcp.FileSystemReader(self.directory), no_dist=True)
        return buffer[chunk["storage_key"]]


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads from one stored tensor only the box `box` (slices in its own coordinates)."""

    def __init__(self, name: str, box: tuple[slice, ...]) -> None:
        super().__init__()
        self.name = name
        self.box = box

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata[self.name]
        wanted = ChunkStorageMetadata(
            offsets=torch.Size(s.start for s in self.box),
            sizes=torch.Size(s.stop - s.start for s in self.box),
        )
        return LoadPlan(create_read_items_for_chunk_list(self.name, stored, [wanted]))

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.state_dict[index.fqn]


def _local(shared: tuple[slice, ...], region: Region) -> tuple[slice, ...]:
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(shared, region.offset, strict=True))
