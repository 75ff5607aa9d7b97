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

A piece may also be a *flattened range* of a box: the distributed optimizer
shards its states by contiguous ranges of flattened parameters, which are
not boxes of the logical tensors. Such a piece names its box (global_offset,
local_shape) and the elements [start, end) of the box's row-major
flattening that its 1-D `data` holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["ShardedTensor", "assemble", "check_tiling"]


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

    flattened_range: tuple[int, int] | None = None
    """(start, end): `data` is 1-D and holds elements start .. end-1 of the box's
    row-major flattening; None: `data` is the whole box."""

    local_shape: tuple[int, ...] | None = None
    """The box's shape when flattened_range is set (else data's shape)."""

    def __post_init__(self) -> None:
        shape = self.shape
        if self.flattened_range is not None:
            start, end = self.flattened_range
            if self.local_shape is None:
                raise ValueError(f"{self.key}: a flattened_range needs the box's local_shape")
            if not 0 <= start < end <= math.prod(shape):
                raise ValueError(
                    f"{self.key}: flattened_range {self.flattened_range} must lie in "
                    f"0 .. {math.prod(shape)} (the box {shape})"
                )
            if self.data.dim() != 1 or self.data.numel() != end - start:
                raise ValueError(
                    f"{self.key}: a flattened piece's data must be 1-D of {end - start} "
                    f"elements, got shape {tuple(self.data.shape)}"
                )
        elif self.local_shape is not None and tuple(self.local_shape) != tuple(self.data.shape):
            raise ValueError(
                f"{self.key}: local_shape {self.local_shape} differs from the data's "
                f"shape {tuple(self.data.shape)}"
            )
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
    def shape(self) -> tuple[int, ...]:
        """The box's shape (data's shape unless the piece is a flattened range)."""
        return tuple(self.local_shape if self.local_shape is not None else self.data.shape)

    @property
    def numel(self) -> int:
        """Elements this piece holds."""
        return self.data.numel()

    @property
    def global_slices(self) -> tuple[slice, ...]:
        """Where the box sits: global_tensor[global_slices] is the box."""
        return tuple(
            slice(start, start + n) for start, n in zip(self.global_offset, self.shape, strict=True)
        )

    def read_from(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This piece's values taken from the whole logical tensor (a new tensor)."""
        if tuple(global_tensor.shape) != tuple(self.global_shape):
            raise ValueError(
                f"{self.key}: global tensor of shape {tuple(global_tensor.shape)}, "
                f"expected {self.global_shape}"
            )
        box = global_tensor[self.global_slices]
        if self.flattened_range is None:
            return box.clone()
        start, end = self.flattened_range
        return box.reshape(-1)[start:end].clone()

    def write_into(self, global_tensor: torch.Tensor) -> None:
        """Copies this piece's values to its place in the whole logical tensor."""
        box = global_tensor[self.global_slices]
        if self.flattened_range is None:
            box.copy_(self.data)
            return
        start, end = self.flattened_range
        if box.is_contiguous():
            box.view(-1)[start:end] = self.data
        else:  # reshape would copy: edit a flat copy and write the whole box back
            flat = box.reshape(-1).clone()
            flat[start:end] = self.data
            box.copy_(flat.view(box.shape))


def assemble(pieces: Iterable[ShardedTensor]) -> dict[str, torch.Tensor]:
    """The whole logical tensors from the pieces of every rank (checked with check_tiling)."""
    pieces = list(pieces)
    shapes = check_tiling(pieces)
    tensors = {}
    for piece in pieces:
        if piece.replica_id != 0:
            continue
        if piece.key not in tensors:
            tensors[piece.key] = torch.empty(shapes[piece.key], dtype=piece.data.dtype)
        piece.write_into(tensors[piece.key])
    return tensors


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
        covered = sum(p.numel for p in saved)
        if covered != math.prod(shape):
            raise ValueError(
                f"{key}: saved pieces cover {covered} of {math.prod(shape)} elements of "
                f"{shape}: a part has no replica_id 0 piece"
            )
        shapes[key] = shape
    return shapes


def _overlap(a: ShardedTensor, b: ShardedTensor) -> bool:
    same_box = a.global_offset == b.global_offset and a.shape == b.shape
    if same_box and a.flattened_range is not None and b.flattened_range is not None:
        (s1, e1), (s2, e2) = a.flattened_range, b.flattened_range
        return s1 < e2 and s2 < e1
    return all(
        s1.start < s2.stop and s2.start < s1.stop
        for s1, s2 in zip(a.global_slices, b.global_slices, strict=True)
    )
