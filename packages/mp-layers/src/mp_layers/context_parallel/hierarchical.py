"""Hierarchical context parallelism (Megatron's --cp-comm-type a2a+p2p with
--hierarchical-context-parallel-sizes inner outer): an all-to-all by heads over the inner
group (consecutive CP ranks, e.g. within a node), then ring attention over the outer one
(across nodes) with 1 / inner of the heads, and the all-to-all back.

The inner group's members hold, together, the two chunks the outer rank would hold if
the sequence were split over the outer ranks alone (chunk r x inner + i of 2 x cp is part
of outer chunk r): after the all-to-all each rank holds those two outer chunks, for its
share of the heads, and the ring runs at the outer size (ring_attention.py). So the
samples are split as for any context parallelism (layout.py at cp = inner x outer).

Shapes as ring_attention.py's; the query groups must divide over the inner size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_layers.context_parallel.block_plan import mixed_seed
from mp_layers.context_parallel.head_split import HeadSplit
from mp_layers.context_parallel.ring_attention import context_parallel_attention
from mp_state import RankGroup

__all__ = ["hierarchical_attention"]


def hierarchical_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: RankGroup,
    levels: tuple[RankGroup, RankGroup],
    scale: float,
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    dropout: float = 0.0,
    dropout_seed: int = 0,
) -> torch.Tensor:
    """Causal attention over the sequence split across `cp_group`, through its `levels`
    (inner, outer). attention(q, k, v): causal attention over whole sequences ([S, b, n, d]
    -> [S, b, n * d]) with this rank's share of the heads (their sinks, the window and
    dropout its own), for an outer group of one rank. Otherwise the ring takes the window,
    the sinks of this rank's heads [nq / inner] out of `sink` [nq], and dropout with masks
    of its own (the seed mixed with the inner rank: each share of the heads its own)."""
    inner, outer = levels
    nq, ng = q.shape[2], k.shape[2]
    if ng % inner.size:
        raise ValueError(
            f"cp_comm_type='a2a+p2p' splits the heads over the inner context-parallel size "
            f"{inner.size}: num_query_groups={ng} (with num_attention_heads={nq}, per "
            "tensor-parallel rank) is not divisible by it"
        )
    if inner.size * outer.size != cp_group.size:
        raise ValueError(f"hierarchical context-parallel groups of {inner.size} x {outer.size} "
                         f"ranks under a context-parallel group of {cp_group.size}")  # fmt: skip

    def ring(q, k, v):
        if outer.size == 1:
            return attention(q, k, v)
        mine = None if sink is None else sink.view(inner.size, -1)[inner.rank]
        return context_parallel_attention(
            q, k, v, outer, scale=scale, comm_type="p2p", window=window, sink=mine,
            dropout=dropout, dropout_seed=mixed_seed(dropout_seed, inner.rank),
        )  # fmt: skip

    if inner.size == 1:
        return ring(q, k, v)
    s, b = q.shape[:2]
    split = HeadSplit(s, b, inner, q.device, levels=(cp_group, outer.size, outer.rank))
    out = ring(*(split.to_heads(t) for t in (q, k, v)))  # [inner s, b, nq / inner * d]
    return split.to_sequence(out.view(inner.size * s, b, nq // inner.size, -1)).flatten(2)
