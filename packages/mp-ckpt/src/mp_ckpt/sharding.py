"""The sharding description: which piece of which global tensor a rank holds.

Models and optimizers describe every parameter as ShardedTensors; checkpoints
store them by logical name and global shape, so that loading under another
layout, or exporting to Hugging Face, is slicing and renaming, never model
code. A fused parameter (QKV, the gated MLP's fc1) is described as its logical
parts: each part's `data` may be a strided view into the fused tensor, with
as many axes as needed to make the part a box of the global tensor (for
grouped-query attention, q as [groups, heads per group, head dim, hidden]).

A piece with replica_id 0 is the copy that gets written; equal pieces on other
ranks (data-parallel copies, a norm weight on every tensor-parallel rank)
carry replica_id > 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["ShardedTensor", "check_tiling"]


@dataclass(frozen=True)
class ShardedTensor:
    """One rank's piece of the logical tensor `key`."""

    key: str
    """Logical, layout-independent name, e.g. "decoder.layers.3.self_attention.q.weight"."""

    data: torch.Tensor
    """The local piece (it may be a view into a fused parameter)."""

    global_shape: tuple[int, ...]
    """Shape of the whole logical tensor."""

    global_offset: tuple[int, ...]
    """Index in the global tensor of the piece's first element, per axis."""

    replica_id: int = 0
    """0 for the copy that is saved; > 0 for identical copies on other ranks."""

    def __post_init__(self) -> None:
        shape = tuple(self.data.shape)
        if not (len(shape) == len(self.global_shape) == len(self.global_offset)):
            raise ValueError(
                f"{self.key}: piece of shape {shape}, global shape {self.global_shape} and "
                f"offset {self.global_offset} must have the same number of axes"
            )
        for axis, (n, total, start) in enumerate(
            zip(shape, self.global_shape, self.global_offset, strict=True)
        ):
            if start < 0 or start + n > total:
                raise ValueError(
                    f"{self.key}: on axis {axis} the piece covers {start}..{start + n}, "
                    f"outside the global size {total}"
                )
        if self.replica_id < 0:
            raise ValueError(f"{self.key}: replica_id={self.replica_id} must be >= 0")

    @classmethod
    def from_rank(
        cls,
        key: str,
        data: torch.Tensor,
        axis: int | None,
        rank: int,
        num_shards: int,
        replica_id: int = 0,
    ) -> ShardedTensor:
        """The piece `rank` of `num_shards` equal splits along `axis` (None: not split)."""
        shape = list(data.shape)
        offset = [0] * len(shape)
        if axis is not None:
            offset[axis] = rank * shape[axis]
            shape[axis] *= num_shards
        return cls(key, data, tuple(shape), tuple(offset), replica_id)

    @property
    def global_slices(self) -> tuple[slice, ...]:
        """Where the piece sits: global_tensor[global_slices] is `data`."""
        return tuple(
            slice(start, start + n)
            for start, n in zip(self.global_offset, self.data.shape, strict=True)
        )


def check_tiling(pieces: Iterable[ShardedTensor]) -> dict[str, tuple[int, ...]]:
    """Checks that the saved pieces of each key cover its global tensor exactly once.

    `pieces` are those of every rank. Returns key -> global shape; raises
    ValueError naming the key on a gap, an overlap, or disagreeing shapes.
    """
    by_key: dict[str, list[ShardedTensor]] = {}
    for piece in pieces:
        by_key.setdefault(piece.key, []).append(piece)
    shapes = {}
    for key, group in by_key.items():
        global_shapes = {p.global_shape for p in group}
        if len(global_shapes) != 1:
            raise ValueError(f"{key}: pieces disagree on the global shape: {sorted(global_shapes)}")
        shape = global_shapes.pop()
        saved = [p for p in group if p.replica_id == 0]
        for i, a in enumerate(saved):
            for b in saved[i + 1 :]:
                if _overlap(a, b):
                    raise ValueError(
                        f"{key}: saved pieces at {a.global_offset} and {b.global_offset} overlap"
                    )
        covered = sum(math.prod(p.data.shape) for p in saved)
        if covered != math.prod(shape):
            raise ValueError(
                f"{key}: saved pieces cover {covered} of {math.prod(shape)} elements of "
                f"{shape}: a part has no replica_id 0 piece"
            )
        shapes[key] = shape
    return shapes


def _overlap(a: ShardedTensor, b: ShardedTensor) -> bool:
    return all(
        s1.start < s2.stop and s2.start < s1.stop
        for s1, s2 in zip(a.global_slices, b.global_slices, strict=True)
    )
