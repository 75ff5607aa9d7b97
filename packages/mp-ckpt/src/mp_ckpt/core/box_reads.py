"""Reading boxes of stored tensors straight into their destinations, through DCP.

    read_boxes(directory, {"w@0,0": [(box, destination), ...], ...}, distributed=False)

A box is a tuple of slices in the stored tensor's own coordinates; its
destination is a tensor (often a view into a larger one) of the box's shape.
DCP reads each stored tensor, cuts the box and copies it into the
destination: no buffer holds the stored tensors between the read and the copy,
so a load needs little memory beyond its targets.

Every DCP load starts by parsing the checkpoint's .metadata (a pickle naming every
stored chunk): a reader that reads a checkpoint piece by piece passes one
KeptMetadataReader to all its loads, which parses it once.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mp_ckpt.core.checkpointer import single_process_quiet
from mp_ckpt.core.regions import Region

__all__ = ["Box", "BoxReads", "KeptMetadataReader", "read_boxes", "stored_buffer"]

Box = tuple[slice, ...]
BoxReads = dict[str, list[tuple[Box, torch.Tensor]]]
"""Stored tensor name -> [(box in its coordinates, destination of the box's shape)]."""


class KeptMetadataReader(dcp.FileSystemReader):
    """DCP's FileSystemReader that parses the checkpoint's .metadata at its first load
    and gives the same parsed object to every later one (DCP's own parses it again at
    each: a whole tensor read piece by piece re-read it per piece). One reader serves
    one thread's loads, one after the other, of a checkpoint that does not change."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._parsed: dict[Any, Metadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._parsed:
            metadata = self.parse_metadata(self._get_metadata_path(rank))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._parsed[rank] = metadata
        metadata = self._parsed[rank]
        metadata.storage_meta.load_id = self.load_id  # this load's, as DCP's reader sets it
        return metadata

    def parse_metadata(self, path: str | os.PathLike) -> Metadata:
        """The .metadata file at `path`, unpickled."""
        with self.fs.create_stream(path, "rb") as stream:
            return pickle.load(stream)


def stored_buffer(chunk: dict) -> tuple[torch.Tensor, Box]:
    """An empty tensor for a whole saved chunk (as mp_metadata.json records it), and the
    box that reads all of it."""
    shape = Region.from_chunk(chunk).stored_shape
    return torch.empty(shape, dtype=getattr(torch, chunk["dtype"])), tuple(
        slice(0, n) for n in shape
    )


def read_boxes(directory: str | os.PathLike, reads: BoxReads, *, distributed: bool,
               storage_reader: dcp.StorageReader | None = None) -> None:  # fmt: skip
    """Fills every destination (collective when distributed: every rank calls it, with
    its own reads, possibly none). storage_reader: DCP's FileSystemReader(directory)
    unless given (a KeptMetadataReader, for a caller that reads one checkpoint in many
    calls)."""
    for name, boxes in reads.items():
        for box, destination in boxes:
            shape = tuple(s.stop - s.start for s in box)
            if tuple(destination.shape) != shape:
                raise ValueError(f"{name}: box {box} has shape {shape}, its destination "
                                 f"{tuple(destination.shape)}")  # fmt: skip
    with single_process_quiet():
        reader = storage_reader or dcp.FileSystemReader(directory)
        dcp.load({}, storage_reader=reader,
                 planner=_BoxReadPlanner(reads), no_dist=not distributed)  # fmt: skip


class _BoxReadPlanner(DefaultLoadPlanner):
    def __init__(self, reads: BoxReads) -> None:
        super().__init__()
        self.reads = reads

    def create_local_plan(self) -> LoadPlan:
        items = []
        for name, boxes in self.reads.items():
            stored = self.metadata.state_dict_metadata[name]
            wanted = [
                ChunkStorageMetadata(offsets=torch.Size(s.start for s in box),
                                     sizes=torch.Size(s.stop - s.start for s in box))
                for box, _ in boxes
            ]  # fmt: skip
            items += create_read_items_for_chunk_list(name, stored, wanted)
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        # The read item's index is the position of its box in the name's list.
        return self.reads[index.fqn][index.index][1]
