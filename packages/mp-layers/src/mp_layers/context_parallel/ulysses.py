"""All-to-all context parallelism (DeepSpeed-Ulysses, Jacobs et al., 2023; Megatron's
--cp-comm-type a2a): before attention an all-to-all turns the sequence-split q, k, v
into head-split ones over the whole sequence, attention runs on whole sequences with
1/cp of the heads, and a second all-to-all turns the output back.

After the first all-to-all the sequence arrives rank by rank, each rank's two
load-balanced chunks side by side; it is put in position order for causal attention
and back in the ranks' order afterwards. Packed samples split by document
(mp_layers.PackedSeqParams) give their chunk order, `order`: each sample is put in
its own position order.

Shapes: q [s, b, nq, d], k and v [s, b, ng, d] with s this rank's tokens; inside
[cp x s, b, nq / cp, d]; the output [s, b, nq * d]. Each group's query heads stay
adjacent, so the heads a rank gets are whole groups: nq and ng must be divisible by
cp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mp_layers.context_parallel.layout import local_positions
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
    # The place in the chunk order of each gathered position, and its inverse.
    arrived = torch.cat([local_positions(s * cp, cp, r) for r in range(cp)]).to(q.device)
    if order is None:
        to_positions = torch.argsort(arrived)  # gathered index of each position
        q, k, v = (_AllToAll.apply(t, cp_group, True)[to_positions] for t in (q, k, v))
        out = attention(q, k, v)  # [cp * s, b, nq / cp * d]
        out = out.view(cp * s, b, nq // cp, -1)[arrived]
        return _AllToAll.apply(out, cp_group, False).flatten(2)
    # Per sample: position p is at place inverse[p] of the chunk order, which arrived at
    # gathered index to_places[inverse[p]].
    order = order.to(q.device)
    samples = torch.arange(b, device=q.device)
    to_positions = torch.argsort(arrived)[torch.argsort(order, dim=1)].t()  # [S, b]
    q, k, v = (_AllToAll.apply(t, cp_group, True)[to_positions, samples] for t in (q, k, v))
    out = attention(q, k, v)
    out = out.view(cp * s, b, nq // cp, -1)[order.t()[arrived], samples]
    return _AllToAll.apply(out, cp_group, False).flatten(2)


def _seq_to_heads(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, b, n, d] -> [cp * s, b, n / cp, d]: head piece r goes to rank r, sequences
    arrive in rank order."""
    s, b, n, d = x.shape
    cp = group.size
    send = x.view(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.group)
    return received.view(cp * s, b, n // cp, d)


def _heads_to_seq(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[cp * s, b, n / cp, d] -> [s, b, n, d]: the inverse of _seq_to_heads."""
    cp = group.size
    total, b, heads, d = x.shape
    send = x.contiguous().view(cp, total // cp, b, heads, d)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.group)
    return received.permute(1, 2, 0, 3, 4).reshape(total // cp, b, cp * heads, d)


class _AllToAll(torch.autograd.Function):
    """_seq_to_heads (to_heads) or _heads_to_seq; backward is the other one."""

    @staticmethod
    def forward(ctx, x, group: RankGroup, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None
