"""broadcast_data: the TP group's first rank hands its batch to the others.

Shapes: whatever the tensors hold, typically [b, s] token ids, labels and
loss masks. Only tensor-parallel rank 0 reads the data loader (Megatron's
get_batch); the other ranks of its group need the same tensors.

Two broadcasts from TP rank 0: first the shapes (a small int64 tensor, one
row per key: the number of dimensions, then up to _MAX_DIMS sizes), so the
other ranks can allocate, then every tensor flattened into one buffer of
`dtype`, which each rank cuts back into the named tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import mp_state
from mp_state import RankGroup

__all__ = ["broadcast_data"]

_MAX_DIMS = 8
"""Most dimensions a broadcast tensor may have (Megatron's limit too)."""


def broadcast_data(
    keys: list[str],
    data: dict[str, torch.Tensor] | None,
    dtype: torch.dtype,
    tp_group: RankGroup,
    *,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """TP rank 0's tensors data[key] for each key, on every rank of tp_group.

    On TP rank 0, `data` must hold every key with tensors of `dtype`; the
    other ranks' `data` is ignored (pass None). Returns new tensors on
    `device` (by default mp_state.select_device(): the rank's GPU, else the
    CPU), the same on every rank of the group. Collective: every rank of the
    group calls it with the same keys and dtype.
    """
    if device is None:
        device = mp_state.select_device().device
    src = tp_group.ranks[0]
    shapes = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64, device=device)
    if tp_group.rank == 0:
        _check(keys, data, dtype)
        for i, key in enumerate(keys):
            shape = data[key].shape
            shapes[i, 0] = len(shape)
            shapes[i, 1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    if tp_group.size > 1:
        dist.broadcast(shapes, src=src, group=tp_group.group)
    sizes = [tuple(row[1 : 1 + row[0]]) for row in shapes.tolist()]
    numels = [math.prod(size) for size in sizes]

    if tp_group.rank == 0:
        flat = torch.cat([data[key].reshape(-1) for key in keys]).to(device)
    else:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
    if tp_group.size > 1:
        dist.broadcast(flat, src=src, group=tp_group.group)
    return {
        key: piece.view(size)
        for key, piece, size in zip(keys, flat.split(numels), sizes, strict=True)
    }


def _check(keys: list[str], data: dict[str, torch.Tensor] | None, dtype: torch.dtype) -> None:
    if data is None:
        raise ValueError("data=None on tensor-parallel rank 0, which must provide the tensors")
    for key in keys:
        if key not in data:
            raise ValueError(f"keys names {key!r}, which data does not hold")
        tensor = data[key]
        if tensor.dtype != dtype:
            raise ValueError(f"data[{key!r}].dtype={tensor.dtype} differs from dtype={dtype}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(
                f"data[{key!r}] has {tensor.dim()} dimensions; at most {_MAX_DIMS} are supported"
            )
