"""Gradients of parameters replicated across a sequence-parallel region.

Shapes: [s/tp, b, h] is an activation split along the sequence.

A parameter applied to a sequence-parallel activation [s/tp, b, h], whole on
every TP rank (a layer norm's weight and bias, a RowParallelLinear's bias
under sequence parallelism), receives on each rank the gradient of its own
piece of the sequence only. The full gradient is their sum over the TP
group. Layers mark such parameters with `param.sequence_parallel = True`
(Megatron's attribute); after the backward, and before gradients are reduced
over data-parallel ranks or clipped, this sums them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_state import RankGroup

__all__ = ["all_reduce_sequence_parallel_grads"]


def all_reduce_sequence_parallel_grads(module: torch.nn.Module, tp_group: RankGroup) -> None:
    """Sums, over `tp_group`, the gradients of module's parameters marked sequence_parallel.

    All marked gradients travel in one flattened all-reduce. A parameter's
    gradient is its `.main_grad` when a data-parallel wrapper keeps one there
    (mp_optim.DistributedDataParallel), else `.grad`. Parameters without a
    gradient are skipped; every rank must hold the same marked
    parameters with gradients, in the same order.
    """
    if tp_group.size == 1:
        return
    marked = (p for p in module.parameters() if getattr(p, "sequence_parallel", False))
    grads = [g for g in map(_grad_of, marked) if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group.group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad
