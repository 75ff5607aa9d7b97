"""Query groups shared by tensor-parallel ranks: num_query_groups below the TP size.

With ng query groups (key/value heads) over tp > ng ranks, each group is shared by
share = tp / ng consecutive ranks (Megatron-LM's rule: tp a multiple of ng). Rank r
serves group g = r // share as its part i = r % share: it computes qg / share of the
group's qg query heads (and as many gate heads), and kv_channels / share rows of the
group's key and of its value head. Its piece of the fused QKV weight is therefore

    [q heads i*qg/share .. (i+1)*qg/share | their gate heads | k rows i*d/share.. | v rows]

every rank holding as many rows, so ColumnParallelLinear splits the weight evenly and
nothing is stored twice. The forward all-gathers the key and value rows over the TP
group and keeps its group's (the backward sums each rank's gradient of them: a
reduce-scatter); the query heads never move. Megatron-LM instead all-gathers every
rank's whole QKV output and keeps its group's, which moves qg + 2 heads per group where
this moves 2.

The TP-independent draws stay: the master is drawn in the TP = 1 order (group by group:
q, gate, k, v) and its rows then put in the ranks' order (`in_rank_order`), so each rank
keeps a contiguous piece of it. The checkpoint's logical tensors are unchanged: each
rank's q, gate, k and v rows are a box of q [ng, qg, d, h], k [ng, d, h], and so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_ckpt import ShardedTensor
from mp_layers.tensor_parallel import InitMethod, all_gather_last_dim_from_tensor_parallel_region
from mp_layers.tensor_parallel.deferred_init import RowOrder
from mp_state import RankGroup

__all__ = ["SharedGroup"]


@dataclass(frozen=True)
class SharedGroup:
    """This rank's part of the query group it shares: the module docstring's layout."""

    groups: int
    """num_query_groups (every rank's: the whole model's)."""
    per_group: int
    """Query heads per group (the whole group's)."""
    gated: bool
    """Whether each group also holds as many output-gate heads."""
    d: int
    """kv_channels."""
    tp: int
    rank: int
    """This rank's index in the TP group."""

    @property
    def share(self) -> int:
        """Ranks per group."""
        return self.tp // self.groups

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.per_group // self.share

    @property
    def rows(self) -> tuple[int, ...]:
        """This rank's rows of each part: q, [gate,] k, v."""
        kv = self.d // self.share
        q = self.heads * self.d
        return (q, q, kv, kv) if self.gated else (q, kv, kv)

    def in_rank_order(self) -> torch.Tensor:
        """The master's rows (in the TP = 1 order) that the ranks hold, rank after rank."""
        qg, d, share = self.per_group, self.d, self.share
        gates = qg if self.gated else 0
        # where each part starts in a group's rows of the TP = 1 order: q, [gate,] k, v
        firsts = [0, *([qg * d] if gates else []), (qg + gates) * d, (qg + gates + 1) * d]
        block = (qg + gates + 2) * d
        order = []
        for rank in range(self.tp):
            base, part = (rank // share) * block, rank % share
            for first, n in zip(firsts, self.rows, strict=True):
                start = base + first + part * n  # this rank's n rows of the part
                order.append(torch.arange(start, start + n))
        return torch.cat(order)

    def init_method(self, draw: InitMethod) -> InitMethod:
        """`draw` over the master in the TP = 1 order, then its rows in rank order."""
        return RowOrder(draw, self.in_rank_order())

    def split(self, mixed: torch.Tensor, tp_group: RankGroup):
        """mixed [s, b, this rank's rows] -> (q [s, b, heads, d], gate [s, b, heads d] or
        None, k [s, b, 1, d], v [s, b, 1, d]): k and v gathered from the group's ranks."""
        s, b = mixed.shape[:2]
        parts = mixed.split(list(self.rows), dim=-1)
        q = parts[0].reshape(s, b, self.heads, self.d)
        gate = parts[1] if self.gated else None
        kv = torch.cat(parts[-2:], dim=-1)  # [s, b, 2 d / share]
        every = all_gather_last_dim_from_tensor_parallel_region(kv, tp_group)
        every = every.view(s, b, self.tp, 2, self.d // self.share)
        mine = every.narrow(2, (self.rank // self.share) * self.share, self.share)
        k = mine[:, :, :, 0].reshape(s, b, 1, self.d)
        v = mine[:, :, :, 1].reshape(s, b, 1, self.d)
        return q, gate, k, v

    def pieces(self, prefix: str, name: str, local: torch.Tensor) -> dict[str, ShardedTensor]:
        """This rank's boxes of the logical q, [gate,] k and v tensors of `local` (the
        fused weight or bias on this rank)."""
        tail = tuple(local.shape[1:])
        group, part = self.rank // self.share, self.rank % self.share
        names = ("q", "gate", "k", "v") if self.gated else ("q", "k", "v")
        found = {}
        for kind, data in zip(names, local.split(list(self.rows)), strict=True):
            if kind in ("q", "gate"):
                data = data.view(1, self.heads, self.d, *tail)
                shape, offset = (self.groups, self.per_group, self.d), (group, part * self.heads, 0)
            else:
                rows = self.d // self.share
                data = data.view(1, rows, *tail)
                shape, offset = (self.groups, self.d), (group, part * rows)
            key = f"{prefix}linear_qkv.{kind}.{name}"
            found[key] = ShardedTensor(key, data, (*shape, *tail), (*offset, *(0,) * len(tail)))
        return found
