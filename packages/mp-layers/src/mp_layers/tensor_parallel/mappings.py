"""Autograd-aware communication between the ranks of a tensor-parallel group.

Shapes: [s, b, h] = sequence, batch, hidden (Megatron's layout); a dimension
written x/tp is split over the group's ranks (rank r holds the r-th
contiguous piece). Tensor parallelism splits the last dimension; sequence
parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models") splits the first. The functions accept any shape: only
the split dimension matters.

Each mapping is a pair of collectives, one in the forward and its adjoint in
the backward (the gradient of an all-gather is a reduce-scatter, of a copy to
every rank an all-reduce, and so on):

    function                                     forward                backward
    copy_to_tensor_model_parallel_region         identity               all-reduce
    reduce_from_tensor_model_parallel_region     all-reduce             identity
    sum_over_tensor_model_parallel_region        all-reduce             all-reduce
    scatter_to_tensor_model_parallel_region      [.., h] -> [.., h/tp]  all-gather last dim
    gather_from_tensor_model_parallel_region     [.., h/tp] -> [.., h]  split last dim
    all_gather_last_dim_from_tensor_parallel_region  [.., h/tp] -> [.., h]  reduce-scatter last dim
    scatter_to_sequence_parallel_region          [s, ..] -> [s/tp, ..]  all-gather first dim
    gather_from_sequence_parallel_region         [s/tp, ..] -> [s, ..]  reduce-scatter (or split)
    reduce_scatter_to_sequence_parallel_region   [s, ..] -> [s/tp, ..]  all-gather first dim

Every function takes the group to communicate over (an mp_state.RankGroup,
such as `state.tp`). In a group of one rank each is the identity, so callers
need no special case for tensor-parallel size 1.
"""

from __future__ import annotations

import torch

from mp_layers.tensor_parallel.collectives import (
    all_reduce,
    gather_first,
    gather_last,
    reduce_scatter_first,
    reduce_scatter_last,
    split_first,
    split_last,
)
from mp_state import RankGroup

__all__ = [
    "all_gather_last_dim_from_tensor_parallel_region",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "sum_over_tensor_model_parallel_region",
]


# Autograd functions: a forward collective and its adjoint.


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last(grad, ctx.group), None


class _AllGatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_last(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first(grad, ctx.group), None, None
        return split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_first(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Identity forward; all-reduce backward.

    Marks where a replicated activation enters per-rank computation (the
    input of a column-parallel layer): each rank's gradient is only its
    part's contribution, so the gradients are summed.
    """
    if group.size == 1:
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """All-reduce forward; identity backward.

    Sums per-rank partial results (the output of a row-parallel layer); the
    gradient of a sum reaches every addend unchanged.
    """
    if group.size == 1:
        return x
    return _ReduceFromTensorParallel.apply(x, group)


def sum_over_tensor_model_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """All-reduce forward; all-reduce backward.

    Sums per-rank partial results that every rank then uses in computation of its own
    (a norm over channels split over the ranks: each rank scales its own channels by the
    total): each rank's gradient of the sum is its part's contribution, so the backward
    sums them, and every addend receives the whole.
    """
    if group.size == 1:
        return x
    return _SumOverTensorParallel.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[.., h] -> [.., h/tp]: keeps this rank's piece of the last dim; backward all-gathers."""
    return _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[.., h/tp] -> [.., h]: all-gathers the last dimension; backward keeps this rank's piece."""
    return _GatherFromTensorParallel.apply(x, group)


def all_gather_last_dim_from_tensor_parallel_region(
    x: torch.Tensor, group: RankGroup
) -> torch.Tensor:
    """[.., h/tp] -> [.., h]: all-gathers the last dimension for computation that differs
    from rank to rank (each rank reads its own part of the gathered tensor), so the
    backward sums the ranks' gradients and keeps this rank's piece (Megatron's name)."""
    if group.size == 1:
        return x
    return _AllGatherLastDim.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, ..] -> [s/tp, ..]: keeps this rank's piece of the sequence; backward all-gathers."""
    return _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: RankGroup, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """[s/tp, ..] -> [s, ..]: all-gathers the sequence.

    The backward depends on what the gathered tensor feeds
    (`tensor_parallel_output_grad`, Megatron's name):

    - True (default): tensor-parallel computation, such as a column-parallel
      layer, so each rank's gradient is a partial sum over its own part of
      the weights; the backward reduce-scatters (sums, then keeps this rank's
      piece of the sequence).
    - False: computation replicated on every rank, whose gradients are
      already complete and equal; the backward only keeps this rank's piece.
    """
    return _GatherFromSequenceParallel.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, ..] -> [s/tp, ..]: sums per-rank partial results and keeps this rank's piece.

    The backward all-gathers the sequence. This replaces the all-reduce after
    a row-parallel layer under sequence parallelism (same bytes moved: an
    all-reduce is a reduce-scatter followed by an all-gather).
    """
    return _ReduceScatterToSequenceParallel.apply(x, group)
