"""The global gradient norm, clipping, and the count of zeros in the gradients.

Each rank passes the gradients it must count: every logical parameter
element is counted on exactly one rank of the reduction groups. Replicas
(a layer norm's weight on tensor-parallel ranks > 0, the last stage's copy
of tied embeddings) are left out by the caller; with the distributed
optimizer each data-parallel rank counts only its own shard. The squares are
then summed over `groups` in turn: sums over orthogonal groups (say dp, then
tp x pp) add up to the sum over all of their ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_state import RankGroup

__all__ = ["clip_grads_by_total_norm", "count_zeros", "get_grad_norm"]


def get_grad_norm(grads: Sequence[torch.Tensor], groups: Sequence[RankGroup]) -> float:
    """The L2 norm of `grads` across `groups` (computed in fp32)."""
    total = torch.zeros((), dtype=torch.float32)
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        total = torch.stack(norms).square().sum()
    return float(_sum_over(total, groups).sqrt())


def clip_grads_by_total_norm(
    grads: Sequence[torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scales `grads` in place by max_norm / (total_norm + 1e-6) when that is below 1."""
    coefficient = max_norm / (total_norm + 1.0e-6)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(list(grads), coefficient)


def count_zeros(grads: Sequence[torch.Tensor], groups: Sequence[RankGroup]) -> int:
    """The number of zero elements in `grads` across `groups`."""
    zeros = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        zeros += grad.numel() - torch.count_nonzero(grad)
    return int(_sum_over(zeros, groups))


def _sum_over(value: torch.Tensor, groups: Sequence[RankGroup]) -> torch.Tensor:
    for group in groups:
        if group.size > 1:
            dist.all_reduce(value, group=group.group)
    return value
