"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al., 2023; Megatron's
--cp-comm-type a2a): before attention an all-to-all turns the sequence-split q, k, v
into head-split ones over the whole sequence, attention runs on whole sequences with
1/cp of the heads, and a second all-to-all turns the output back.

The all-to-alls and the reordering into position order (and per sample, for packed
samples split by document) are HeadSplit's (head_split.py).

Shapes: q [s, b, nq, d], k and v [s, b, ng, d] with s this rank's tokens; inside
[cp x s, b, nq / cp, d]; the output [s, b, nq * d]. Each group's query heads stay
adjacent, so the heads a rank gets are whole groups: nq and ng must be divisible by
cp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_layers.context_parallel.head_split import HeadSplit
from mp_state import RankGroup

__all__ = ["ulysses_attention"]


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: RankGroup,
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention(q, k, v)` (causal, [S, b, n, d] -> [S, b, n * d]) over the whole
    sequence with this rank's share of the heads. order: [b, S], the sample position at
    each place of the chunk order (None: the positions themselves)."""
    cp = cp_group.size
    nq, ng = q.shape[2], k.shape[2]
    if ng % cp:
        raise ValueError(
            f"cp_comm_type='a2a' splits the heads over context_parallel_size={cp}: "
            f"num_query_groups={ng} (with num_attention_heads={nq}) is not divisible by it"
        )
    if cp == 1:
        return attention(q, k, v)
    s, b = q.shape[:2]
    split = HeadSplit(s, b, cp_group, q.device, order)
    out = attention(*(split.to_heads(t) for t in (q, k, v)))  # [cp * s, b, nq / cp * d]
    return split.to_sequence(out.view(cp * s, b, nq // cp, -1)).flatten(2)
