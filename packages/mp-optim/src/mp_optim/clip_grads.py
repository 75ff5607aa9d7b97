"""The global gradient norm, clipping, and the count of zeros in the gradients.

Each rank passes the gradients it must count: every logical parameter
element is counted on exactly one rank of the reduction groups. Replicas
(a layer norm's weight on tensor-parallel ranks > 0, the last stage's copy
of tied embeddings) are left out by the caller; with the distributed
optimizer each data-parallel rank counts only its own shard. The squares are
then summed over `groups` in turn: sums over orthogonal groups (say dp, then
tp x pp) add up to the sum over all of their ranks.

Expert parameters of mixture-of-experts layers are split over other ranks
(expert tp x ep x pp, and expert dp for the distributed optimizer's shards),
so their squares (or zeros) are passed apart, as `expert_grads`, and summed
over `expert_groups`; the two totals are added before the square root. Every
rank of a run must pass expert_groups alike (None, or groups), even a rank
without expert parameters: the sums are collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_state import RankGroup, select_device

__all__ = ["clip_coefficient", "clip_grads_by_total_norm", "count_zeros", "get_grad_norm"]


def get_grad_norm(
    grads: Sequence[torch.Tensor],
    groups: Sequence[RankGroup],
    *,
    expert_grads: Sequence[torch.Tensor] = (),
    expert_groups: Sequence[RankGroup] | None = None,
) -> float:
    """The L2 norm of `grads` across `groups` and `expert_grads` across `expert_groups`
    (computed in fp32)."""
    squares = _dense_and_expert(_sum_of_squares, grads, groups, expert_grads, expert_groups)
    return float(squares.sqrt())


def clip_grads_by_total_norm(
    grads: Sequence[torch.Tensor], max_norm: float, total_norm: float
) -> None:
    """Scales `grads` in place by max_norm / (total_norm + 1e-6) when that is below 1."""
    coefficient = clip_coefficient(max_norm, total_norm)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(list(grads), coefficient)


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """What clipping to `max_norm` scales gradients of norm `total_norm` by (1: none)."""
    return min(1.0, max_norm / (total_norm + 1.0e-6))


def count_zeros(
    grads: Sequence[torch.Tensor],
    groups: Sequence[RankGroup],
    *,
    expert_grads: Sequence[torch.Tensor] = (),
    expert_groups: Sequence[RankGroup] | None = None,
) -> int:
    """The number of zero elements in `grads` across `groups` plus those of
    `expert_grads` across `expert_groups`."""
    return int(_dense_and_expert(_zeros, grads, groups, expert_grads, expert_groups))


def _dense_and_expert(measure, grads, groups, expert_grads, expert_groups) -> torch.Tensor:
    """measure(grads) summed over groups plus measure(expert_grads) over expert_groups."""
    device = _device_of(grads, expert_grads)
    total = _sum_over(measure(grads, device), groups)
    if expert_groups is not None:
        total = total + _sum_over(measure(expert_grads, device), expert_groups)
    elif expert_grads:
        raise ValueError(f"{len(expert_grads)} expert gradients given without expert_groups")
    return total


def _device_of(*grad_lists: Sequence[torch.Tensor]) -> torch.device:
    """Where the totals live: with the gradients, or on the run's device for a rank
    without any (it still joins the collectives)."""
    for grads in grad_lists:
        if grads:
            return grads[0].device
    return select_device().device


def _sum_of_squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    pieces = [g.float() if g.dtype != torch.float32 else g for g in grads]
    pieces = [p for g in pieces for p in _cpu_pieces(g)]
    norms = torch._foreach_norm(pieces)
    return torch.stack(norms).double().square().sum().float().to(device)


_CPU_PIECE = 16384


def _cpu_pieces(grad: torch.Tensor) -> list[torch.Tensor]:
    """A CPU gradient as pieces of at most _CPU_PIECE elements. torch's fp32 norm on the
    CPU accumulates long runs in fp32 lanes: a 16M-element tensor's norm came out 1.3e-3
    relative from the fp64 one (2.7e-6 for 131k elements), 4e-8 when summed in pieces of
    16384, in 1.8x the time; GPUs reduce in trees and need no pieces."""
    if grad.device.type != "cpu" or grad.numel() <= _CPU_PIECE:
        return [grad]
    return list(grad.reshape(-1).split(_CPU_PIECE))


def _zeros(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    zeros = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        zeros += grad.numel() - torch.count_nonzero(grad)
    return zeros


def _sum_over(value: torch.Tensor, groups: Sequence[RankGroup]) -> torch.Tensor:
    for group in groups:
        if group.size > 1:
            dist.all_reduce(value, group=group.group)
    return value
