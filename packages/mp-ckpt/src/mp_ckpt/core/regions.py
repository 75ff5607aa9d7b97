"""Copying between two pieces of one logical tensor: the heart of resharding.

A region is a box of the global tensor (offset, shape), optionally narrowed
to a range [start, end) of the box's row-major flattening (the distributed
optimizer's pieces). Loading under another layout copies, for every target
piece, the elements it shares with every saved piece that overlaps it. Two
whole boxes share a box, copied by slicing; when either side is a flattened
range the shared elements are found with index arithmetic over the two
boxes' intersection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Region", "copy_shared", "local_box"]


@dataclass(frozen=True)
class Region:
    """A piece's place in its global tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    flattened_range: tuple[int, int] | None = None

    @classmethod
    def from_chunk(cls, chunk: dict) -> Region:
        """The region of a saved chunk as mp_metadata.json records it."""
        flat = chunk["flattened_range"]
        return cls(tuple(chunk["offset"]), tuple(chunk["shape"]), tuple(flat) if flat else None)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the piece as stored: its flat range's length, or its box."""
        flat = self.flattened_range
        return (flat[1] - flat[0],) if flat else self.shape

    def box_overlap(self, other: Region) -> tuple[slice, ...] | None:
        """The intersection of the two boxes in global coordinates, or None."""
        bounds = []
        for a0, an, b0, bn in zip(self.offset, self.shape, other.offset, other.shape, strict=True):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if lo >= hi:
                return None
            bounds.append(slice(lo, hi))
        return tuple(bounds)


def copy_shared(source: torch.Tensor, source_region: Region, target: torch.Tensor,
                target_region: Region) -> int:  # fmt: skip
    """Copies the elements both regions hold from `source` into `target`; returns how many.

    `source` / `target` hold their region's elements: the box itself, or the
    1-D flattened range.
    """
    shared = source_region.box_overlap(target_region)
    if shared is None:
        return 0
    if source_region.flattened_range is None and target_region.flattened_range is None:
        dst = target[local_box(shared, target_region)]
        dst.copy_(source[local_box(shared, source_region)])
        return dst.numel()
    src_index, src_ok = _flat_positions(shared, source_region)
    dst_index, dst_ok = _flat_positions(shared, target_region)
    both = src_ok & dst_ok
    if not bool(both.any()):
        return 0
    values = _read(source, source_region, shared, src_index, both)
    _write(target, target_region, shared, dst_index, both, values)
    return int(both.sum())


def local_box(shared: tuple[slice, ...], region: Region) -> tuple[slice, ...]:
    """A box given in global coordinates, in the region's own (its offset subtracted)."""
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(shared, region.offset, strict=True))


def _flat_positions(shared, region: Region) -> tuple[torch.Tensor, torch.Tensor]:
    """For each element of the shared box: its index in the region's box flattening,
    and whether the region holds it."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    dims = len(region.shape)
    for axis in reversed(range(dims)):
        s, o = shared[axis], region.offset[axis]
        along = torch.arange(s.start - o, s.stop - o, dtype=torch.int64) * stride
        index = index + along.view([-1 if d == axis else 1 for d in range(dims)])
        stride *= region.shape[axis]
    index = index.expand(tuple(s.stop - s.start for s in shared))
    if region.flattened_range is None:
        return index, torch.ones(index.shape, dtype=torch.bool)
    start, end = region.flattened_range
    return index, (index >= start) & (index < end)


def _read(source, region: Region, shared, index, mask) -> torch.Tensor:
    if region.flattened_range is None:
        return source[local_box(shared, region)][mask]
    return source[index[mask] - region.flattened_range[0]]


def _write(target, region: Region, shared, index, mask, values) -> None:
    if region.flattened_range is None:
        box = target[local_box(shared, region)]
        box[mask] = values.to(box.dtype)
        return
    target[index[mask] - region.flattened_range[0]] = values.to(target.dtype)
