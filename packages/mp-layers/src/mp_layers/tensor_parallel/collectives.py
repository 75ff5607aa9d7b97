"""Plain collectives over a RankGroup, without autograd: the building blocks
of the mappings and of the layers' own backward passes.

Shapes: "first" is the sequence dimension [s, ..] that sequence parallelism
splits, "last" the hidden dimension [.., h] that tensor parallelism splits;
x/tp is rank r's r-th contiguous piece. In a group of one rank every function
returns its input.

Each returns a new tensor and leaves its input alone: autograd may hand the
same gradient tensor to several functions, so an in-place all-reduce could
corrupt another branch's input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.tensor_parallel.partition import divide
from mp_state import RankGroup

__all__ = [
    "all_reduce",
    "gather_first",
    "gather_last",
    "reduce_scatter_first",
    "reduce_scatter_last",
    "split_first",
    "split_last",
]


def all_reduce(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Sum over the group (a new tensor)."""
    if group.size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group.group)
    return out


def split_last(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[.., h] -> [.., h/tp]: this rank's piece of the last dimension."""
    if group.size == 1:
        return x
    piece = divide(x.shape[-1], group, "input.shape[-1]")
    start = group.rank * piece
    return x[..., start : start + piece].contiguous()


def gather_last(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[.., h/tp] -> [.., h]: the pieces of every rank, in rank order."""
    if group.size == 1:
        return x
    # Gathered flat into one contiguous buffer, then moved:
    # [tp, .., h/tp] -> [.., tp, h/tp] -> [.., h].
    x = x.contiguous()
    flat = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.view(-1), group=group.group)
    stacked = flat.view(group.size, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], group.size * x.shape[-1])


def split_first(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, ..] -> [s/tp, ..]: this rank's piece of the first dimension."""
    if group.size == 1:
        return x
    piece = divide(x.shape[0], group, "input.shape[0]")
    start = group.rank * piece
    return x[start : start + piece].contiguous()


def gather_first(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s/tp, ..] -> [s, ..]: the pieces of every rank, in rank order."""
    if group.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group.group)
    return out


def reduce_scatter_first(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, ..] -> [s/tp, ..]: this rank's piece of the sum over the group."""
    if group.size == 1:
        return x
    piece = divide(x.shape[0], group, "input.shape[0]")
    out = torch.empty((piece, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group.group)
    return out


def reduce_scatter_last(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[.., h] -> [.., h/tp]: this rank's piece of the last dimension of the sum over the
    group."""
    if group.size == 1:
        return x
    piece = divide(x.shape[-1], group, "input.shape[-1]")
    # [.., tp * piece] -> [tp, .., piece]: each rank's piece contiguous, in rank order
    stacked = x.reshape(*x.shape[:-1], group.size, piece).movedim(-2, 0).contiguous()
    out = torch.empty((1, *stacked.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, stacked, group=group.group)
    return out[0]
