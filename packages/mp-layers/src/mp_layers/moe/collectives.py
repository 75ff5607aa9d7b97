"""Differentiable collectives of uneven sizes along the first dimension, for tokens
travelling to their experts (each rank sends and receives as many tokens as the router
chose).

    all_to_all(x, group, output_splits, input_splits)   rows x[sum(input_splits[:j]) ...] go
                                                         to rank j; backward sends back
    gather_uneven(x, group, sizes)                      every rank's rows, in rank order;
                                                         backward sums and keeps this rank's
    reduce_scatter_uneven(x, group, sizes)              the sum over ranks, this rank's rows;
                                                         backward gathers

`sizes` lists the rows of every rank of the group. Gathers and reduce-scatters pad each
rank's rows to the largest so that one collective of equal pieces moves them (gloo and
NCCL both have those).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_state import RankGroup

__all__ = ["all_to_all", "gather_uneven", "reduce_scatter_uneven"]


def all_to_all(
    x: torch.Tensor, group: RankGroup, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Sends input_splits[j] rows of x to rank j and receives output_splits[j] from it."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, output_splits, input_splits)


def gather_uneven(x: torch.Tensor, group: RankGroup, sizes: list[int]) -> torch.Tensor:
    """[sizes[rank], ..] -> [sum(sizes), ..]; the backward reduce-scatters (the gathered
    rows feed computation split over the group, whose gradients are partial sums)."""
    if group.size == 1:
        return x
    return _GatherUneven.apply(x, group, sizes)


def reduce_scatter_uneven(x: torch.Tensor, group: RankGroup, sizes: list[int]) -> torch.Tensor:
    """[sum(sizes), ..] -> [sizes[rank], ..]: this rank's rows of the sum over the group."""
    if group.size == 1:
        return x
    return _ReduceScatterUneven.apply(x, group, sizes)


def _all_to_all(x, group, output_splits, input_splits):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group.group)
    return out


def _gather(x: torch.Tensor, group: RankGroup, sizes: list[int]) -> torch.Tensor:
    largest = max(sizes)
    padded = x.new_zeros((largest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((group.size * largest, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group.group)
    return torch.cat([piece[:n] for piece, n in zip(out.chunk(group.size), sizes, strict=True)])


def _reduce_scatter(x: torch.Tensor, group: RankGroup, sizes: list[int]) -> torch.Tensor:
    largest = max(sizes)
    padded = x.new_zeros((group.size, largest, *x.shape[1:]))
    for piece, rows, n in zip(padded, x.split(sizes), sizes, strict=True):
        piece[:n] = rows
    out = x.new_empty((largest, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded.flatten(0, 1), group=group.group)
    return out[: sizes[group.rank]]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.sizes), None, None
