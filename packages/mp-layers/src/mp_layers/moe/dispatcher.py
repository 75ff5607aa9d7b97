"""Token dispatchers: tokens to the ranks that hold their experts, sorted by expert, and
the experts' outputs back, weighted by the router and summed per token.

Shapes: hidden [T, h] (this rank's tokens), probs and routing_map [T, E] (router.py);
what the experts get is tokens [N, h] sorted by local expert with counts [El] and each
copy's routing probability [N] (the experts weight their outputs by it, experts.py);
combine sums the experts' weighted [N, h] back into [T, h].

Permuting is a sort by expert, never a loop over tokens: the (expert, token) pairs of
the routing map in expert-major order give each routed copy's token index and weight;
the output is an index_add of the copies' (weighted) outputs.

- AllToAllDispatcher (Megatron's "alltoall"): a rank sends each expert-parallel rank the
  copies routed to its experts (an all-to-all of uneven pieces over ep, the counts
  exchanged first), then the expert-TP ranks pool what they received (an uneven gather
  over expert_tp): each holds a slice of every local expert's weights and computes all
  their tokens. The pieces arrive grouped by source rank; they are regrouped by local
  expert for the grouped matmul, and everything is undone in reverse after the experts
  (an uneven reduce-scatter over expert_tp sums the slices' partial outputs).
- AllGatherDispatcher (Megatron's "allgather"): every rank of tp_ep (expert_tp x ep)
  gathers all their tokens and routing and picks those routed to its local experts; the
  weighted outputs, scattered back over all gathered tokens, are reduce-scattered over
  tp_ep (summing the experts of other ranks and the expert-TP partial sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_layers.moe.collectives import all_to_all, gather_uneven, reduce_scatter_uneven
from mp_layers.tensor_parallel.collectives import gather_first
from mp_layers.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mp_state import RankGroup

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "permutation"]


@dataclass
class Permutation:
    """The routed copies in expert-major order: their token index and routing weight."""

    token_index: torch.Tensor  # [M]
    weights: torch.Tensor  # [M]
    counts: torch.Tensor  # [E'] copies per expert


def permutation(probs: torch.Tensor, routing_map: torch.Tensor) -> Permutation:
    """probs, routing_map [T, E'] -> the copies sorted by expert (then token)."""
    tokens = routing_map.shape[0]
    by_expert = routing_map.t()
    token_index = torch.arange(tokens, device=probs.device).expand_as(by_expert)
    return Permutation(
        token_index.masked_select(by_expert),
        probs.t().masked_select(by_expert),
        by_expert.sum(dim=1),
    )


def unpermute(out: torch.Tensor, plan: Permutation, tokens: int) -> torch.Tensor:
    """[M, h] weighted outputs of the copies -> [tokens, h]: summed per token."""
    result = out.new_zeros((tokens, out.shape[-1]))
    return result.index_add(0, plan.token_index, out)


class AllToAllDispatcher:
    def __init__(self, num_experts: int, ep: RankGroup, expert_tp: RankGroup) -> None:
        self.ep, self.etp = ep, expert_tp
        self.num_local = num_experts // ep.size

    def dispatch(self, hidden, probs, routing_map):
        plan = permutation(probs, routing_map)
        copies = hidden.index_select(0, plan.token_index)
        send = plan.counts.view(self.ep.size, self.num_local)  # [ep, El]
        received = _exchange_counts(send, self.ep)  # [ep, El]: from each source
        grid = gather_first(received.unsqueeze(0), self.etp)  # [etp, ep, El]
        state = _AllToAllState(plan, hidden.shape[0], send.sum(1).tolist(),
                               received.sum(1).tolist(), grid.sum((1, 2)).tolist(),
                               grid.reshape(-1, self.num_local))  # fmt: skip
        x, weights = (self._to_experts(t, state) for t in (copies, plan.weights[:, None]))
        return x, state.chunks.sum(0).tolist(), weights[:, 0], state

    def _to_experts(self, rows: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        """The copies' rows on the ranks of their experts, grouped by local expert."""
        rows = all_to_all(rows, self.ep, state.received_splits, state.sent_splits)
        return _regroup(gather_uneven(rows, self.etp, state.pooled_sizes), state.chunks)

    def combine(self, out: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        out = _regroup(out, state.chunks.t())
        out = reduce_scatter_uneven(out, self.etp, state.pooled_sizes)
        out = all_to_all(out, self.ep, state.sent_splits, state.received_splits)
        return unpermute(out, state.plan, state.tokens)


@dataclass
class _AllToAllState:
    plan: Permutation
    tokens: int
    sent_splits: list[int]
    received_splits: list[int]
    pooled_sizes: list[int]
    chunks: torch.Tensor  # [etp * ep sources, El]: copies per (source, local expert)


def _exchange_counts(send: torch.Tensor, ep: RankGroup) -> torch.Tensor:
    if ep.size == 1:
        return send
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=ep.group)
    return received


def _regroup(x: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Rows in chunks[i, j] (row-major) -> the same chunks in column-major order."""
    if chunks.shape[0] == 1 or chunks.shape[1] == 1:
        return x
    pieces = x.split(chunks.flatten().tolist())
    rows, cols = chunks.shape
    return torch.cat([pieces[i * cols + j] for j in range(cols) for i in range(rows)])


class AllGatherDispatcher:
    def __init__(self, num_experts: int, ep: RankGroup, tp_ep: RankGroup) -> None:
        self.tp_ep = tp_ep
        num_local = num_experts // ep.size
        self.local = slice(ep.rank * num_local, (ep.rank + 1) * num_local)

    def dispatch(self, hidden, probs, routing_map):
        if self.tp_ep.size > 1:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_ep)
            probs = gather_from_sequence_parallel_region(probs, self.tp_ep)
            routing_map = gather_first(routing_map.to(torch.uint8), self.tp_ep).bool()
        plan = permutation(probs[:, self.local], routing_map[:, self.local])
        return (
            hidden.index_select(0, plan.token_index),
            plan.counts.tolist(),
            plan.weights,
            (plan, hidden.shape[0]),
        )

    def combine(self, out: torch.Tensor, state) -> torch.Tensor:
        plan, tokens = state
        out = unpermute(out, plan, tokens)
        if self.tp_ep.size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_ep)
        return out
