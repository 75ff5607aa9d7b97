"""The layer-wise distributed optimizer's split: whole parameters per data-parallel rank.

Muon needs whole matrices, which the distributed optimizer's flat shards cut. With
use_layer_wise_distributed_optimizer (Megatron's LayerWiseDistributedOptimizer) the
gradients are all-reduced as in plain data parallelism, each parameter is stepped by one
data-parallel rank (its owner, which alone keeps its main parameter and optimizer state),
and after the step every owner broadcasts its parameters to the others.

Owners balance the elements: parameters by size, largest first (ties in model order),
each to the rank that owns the fewest elements so far (the lowest such rank). Every rank
computes the same split from the same model, so nothing is exchanged to agree on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mp_state import RankGroup

__all__ = ["assign_owners", "broadcast_from_owners"]


def assign_owners(params: list[torch.Tensor], ranks: int) -> list[int]:
    """The owning rank (0 .. ranks-1) of each parameter, in the order given."""
    load = [0] * ranks
    owners = [0] * len(params)
    by_size = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    for i in by_size:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += params[i].numel()
    return owners


def broadcast_from_owners(params: list[torch.Tensor], owners: list[int], group: RankGroup) -> None:
    """Every rank of `group` gets each parameter's value from its owner: one broadcast per
    owner and dtype, of that owner's parameters flattened."""
    if group.size == 1:
        return
    for owner in range(group.size):
        mine = [p for p, o in zip(params, owners, strict=True) if o == owner]
        for dtype in sorted({p.dtype for p in mine}, key=str):
            tensors = [p.data for p in mine if p.dtype == dtype]
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=group.ranks[owner], group=group.group)
            if group.rank != owner:
                for tensor, value in zip(
                    tensors, _unflatten_dense_tensors(flat, tensors), strict=True
                ):
                    tensor.copy_(value)
