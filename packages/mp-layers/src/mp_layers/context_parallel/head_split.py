"""The all-to-all of context parallelism by heads: from this rank's part of the sequence
with every head ([s, b, n, ...], its two load-balanced chunks side by side) to the whole
sequence, in position order, with 1/cp of the heads ([cp x s, b, n / cp, ...]), and back.
All-to-all attention (ulysses.py, Megatron's --cp-comm-type a2a) and the Mamba mixers
(Megatron's MambaContextParallel) run on whole sequences this way.

After the all-to-all the sequence arrives rank by rank, each rank's two chunks side by
side; `HeadSplit` puts it in position order and back. Packed samples split by document
(mp_layers.PackedSeqParams) give their chunk order, `order`: each sample is put in its
own position order. Head piece r (heads r n / cp to (r + 1) n / cp - 1) goes to CP rank
r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.context_parallel.layout import local_positions
from mp_state import RankGroup

__all__ = ["HeadSplit"]


class HeadSplit:
    """The reordering for samples of `s` positions here (cp x s in all), `b` of them, on
    `device`. order: [b, cp x s], the sample position at each place of the chunk order
    (None: the positions themselves).

    Over part of the context-parallel ranks (hierarchical context parallelism's inner
    group): `levels` = (the whole CP group, the outer group's size and this rank's place
    in it); the group's members are consecutive CP ranks, whose chunks make up the outer
    rank's two chunks of the sequence, and the gathered positions are put in that rank's
    local order (layout.py at the outer size) instead of position order."""

    def __init__(
        self, s: int, b: int, cp_group: RankGroup, device: torch.device,
        order: torch.Tensor | None = None, levels: tuple[RankGroup, int, int] | None = None,
    ) -> None:  # fmt: skip
        self.cp_group = cp_group
        cp = cp_group.size
        if levels is not None:
            whole, outer, outer_rank = levels
            total = s * whole.size
            members = [whole.ranks.index(r) for r in cp_group.ranks]
            arrived = torch.cat([local_positions(total, whole.size, r) for r in members])
            wanted = local_positions(total, outer, outer_rank)
            place = torch.full((total,), -1, dtype=torch.long)
            place[arrived] = torch.arange(len(arrived))
            self._in = (place[wanted].to(device),)  # gathered index of each wanted position
            place[wanted] = torch.arange(len(wanted))
            self._out = (place[arrived].to(device),)
            return
        # The place in the chunk order of each gathered position, and its inverse.
        arrived = torch.cat([local_positions(s * cp, cp, r) for r in range(cp)]).to(device)
        if order is None:
            self._in = (torch.argsort(arrived),)  # gathered index of each position
            self._out = (arrived,)
            return
        # Per sample: position p is at place inverse[p] of the chunk order, which arrived
        # at gathered index to_places[inverse[p]].
        order = order.to(device)
        samples = torch.arange(b, device=device)
        self._in = (torch.argsort(arrived)[torch.argsort(order, dim=1)].t(), samples)  # [S, b]
        self._out = (order.t()[arrived], samples)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, n, ...] -> [cp x s, b, n / cp, ...], the sequence in position order."""
        return _AllToAll.apply(x, self.cp_group, True)[self._in]

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[cp x s, b, n / cp, ...] in position order -> [s, b, n, ...]: to_heads' inverse."""
        return _AllToAll.apply(x[self._out], self.cp_group, False)


def _seq_to_heads(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[s, b, n, ...] -> [cp * s, b, n / cp, ...]: head piece r goes to rank r, sequences
    arrive in rank order."""
    s, b, n, *rest = x.shape
    cp = group.size
    send = x.reshape(s, b, cp, n // cp, *rest).movedim(2, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.group)
    return received.view(cp * s, b, n // cp, *rest)


def _heads_to_seq(x: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[cp * s, b, n / cp, ...] -> [s, b, n, ...]: the inverse of _seq_to_heads."""
    cp = group.size
    total, b, heads, *rest = x.shape
    send = x.contiguous().view(cp, total // cp, b, heads, *rest)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.group)
    return received.movedim(0, 2).reshape(total // cp, b, cp * heads, *rest)


class _AllToAll(torch.autograd.Function):
    """_seq_to_heads (to_heads) or _heads_to_seq; backward is the other one."""

    @staticmethod
    def forward(ctx, x, group: RankGroup, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None
