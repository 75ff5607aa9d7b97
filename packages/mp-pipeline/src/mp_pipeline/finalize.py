"""The step after the last backward of a global batch (Megatron's finalize_model_grads).

    config.finalize_model_grads_func = functools.partial(finalize_model_grads, state=state)

In order:
1. each model chunk's data-parallel gradient reduction is finished
   (`chunk.finish_grad_sync()`, as mp_optim.DistributedDataParallel has);
2. sequence-parallel gradients: parameters marked `sequence_parallel = True`
   (layer norms and row-parallel biases applied to a sequence-split
   activation) hold the gradient of their rank's part of the sequence only;
   they are summed over the tensor-parallel group;
3. tied embeddings: parameters marked `shared_embedding = True` (the input
   embedding on the first stage and its copy on the last) are all-reduced
   over the embedding group, so both copies take the same step;
4. with per-token loss normalization, the gradients are divided by the
   tokens of the whole global batch: the last stage's count, broadcast over
   the pipeline and summed over data-parallel ranks (at least 1: a batch without
   loss tokens keeps its zero gradients, as in Megatron-LM).

A parameter's gradient is its `.main_grad` when a data-parallel wrapper keeps
one there, else `.grad`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_state import ParallelState, RankGroup

__all__ = ["finalize_model_grads"]


def finalize_model_grads(
    model_chunks: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    *,
    state: ParallelState,
) -> None:
    """Finishes this rank's gradients of a global batch (see the module docstring)."""
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    _all_reduce_grads([p for p in params if getattr(p, "sequence_parallel", False)], state.tp)
    if state.embedding is not None:
        shared = [p for p in params if getattr(p, "shared_embedding", False)]
        _all_reduce_grads(shared, state.embedding)
    if num_tokens is not None:  # given on every rank of a per-token-loss run
        _scale_by_tokens(params, num_tokens, state)


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _all_reduce_grads(params: list[torch.nn.Parameter], group: RankGroup) -> None:
    grads = [g for g in map(_grad, params) if g is not None]
    if group.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group.group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


def _scale_by_tokens(params, num_tokens: torch.Tensor, state: ParallelState) -> None:
    """Per-token normalization: the last stage's token count, summed over dp."""
    tokens = torch.as_tensor(num_tokens, dtype=torch.float64).reshape(1).clone()
    if state.pp.size > 1:
        dist.broadcast(tokens, src=state.pp.ranks[-1], group=state.pp.group)
    if state.dp_cp.size > 1:
        dist.all_reduce(tokens, group=state.dp_cp.group)
    # A global batch without loss tokens (every conversation of an SFT batch cut before
    # its answer) has zero gradients: divided by 1, as Megatron-LM clamps the count.
    total = max(float(tokens[0]), 1.0)
    for grad in filter(lambda g: g is not None, map(_grad, params)):
        grad.div_(total)
