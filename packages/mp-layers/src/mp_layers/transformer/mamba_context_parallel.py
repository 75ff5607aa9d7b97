"""Which heads of a Mamba mixer each context-parallel rank mixes, and with which slices of
the mixer's parameters (Megatron's MambaContextParallel).

A tensor-parallel rank holds g groups of hg heads. Under context parallelism (cp ranks)
the mixer needs whole sequences, so its in_proj output goes through an all-to-all
(context_parallel/head_split.py) that gives each CP rank the whole sequence of a share of
the heads. The unit that moves is a *virtual group*: hv heads with the z, x and dt rows
of those heads and their group's B and C rows, [hv p, hv p, n, n, hv].

- g divisible by cp: the virtual groups are the groups (hv = hg); CP rank c mixes groups
  c g / cp to (c + 1) g / cp - 1, and the gated norm, per group, stays on it.
- cp divisible by g (fewer groups than ranks, as at Nemotron 3 Super's 8 groups at TP 8 x
  CP 2): each group is cut into r = cp / g virtual groups of hv = hg / r heads, each
  carrying a copy of the group's B and C (`spread`; their gradients add up in backward),
  one per CP rank. A group's norm then spans r ranks, so the mixer gates on the CP rank
  and normalizes after the all-to-all back (`norm_after`), as Megatron's mixer does.

`Split.indices` gives the rows of conv1d (x, B, C) and of the per-head parameters
(dt_bias, A_log, D) of a CP rank's virtual groups; the parameters stay whole on every CP
rank, each rank's gradient filling its slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Split", "check_split"]


def check_split(groups: int, heads: int, cp: int) -> None:
    """Megatron's rules: heads (of a tensor-parallel rank) divisible by cp, and its groups
    a multiple or a divisor of cp."""
    if heads % cp:
        raise ValueError(
            f"{heads} Mamba heads per tensor-parallel rank are not divisible by "
            f"context_parallel_size={cp}"
        )
    if groups % cp and cp % groups:
        raise ValueError(
            f"{groups} Mamba groups per tensor-parallel rank and context_parallel_size={cp}: "
            "one must divide the other (each rank mixes whole groups, or a share of one "
            "group's heads)"
        )


@dataclass(frozen=True)
class Split:
    """The virtual groups of CP rank `rank` of `cp`, for g groups of hg heads of p channels
    and a state of n."""

    g: int
    hg: int
    p: int
    n: int
    cp: int
    rank: int

    @property
    def r(self) -> int:
        """Virtual groups per group: 1, or cp / g with fewer groups than ranks."""
        return 1 if self.g % self.cp == 0 else self.cp // self.g

    @property
    def hv(self) -> int:
        """Heads of a virtual group."""
        return self.hg // self.r

    @property
    def here(self) -> int:
        """Virtual groups this CP rank mixes."""
        return self.g * self.r // self.cp

    @property
    def norm_after(self) -> bool:
        """Whether a group's heads span CP ranks, so that its norm runs after the
        all-to-all back."""
        return self.r > 1

    def spread(self, fused: torch.Tensor) -> torch.Tensor:
        """in_proj's output [s, b, g, unit] -> [s, b, g r, virtual unit]: each group's z, x
        and dt cut into r pieces of hv heads, its B and C repeated beside each."""
        if self.r == 1:
            return fused
        s, b = fused.shape[:2]
        hg, p, n, r, hv = self.hg, self.p, self.n, self.r, self.hv
        z, x, B, C, dt = fused.split([hg * p, hg * p, n, n, hg], dim=-1)
        pieces = [t.reshape(s, b, self.g, r, -1) for t in (z, x)]
        shared = [t[:, :, :, None].expand(s, b, self.g, r, n) for t in (B, C)]
        dt = dt.reshape(s, b, self.g, r, hv)
        return torch.cat([*pieces, *shared, dt], dim=-1).view(s, b, self.g * r, -1)

    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv1d rows [here (hv p + 2n)], head rows [here hv]) of this rank's virtual
        groups, into the tensor-parallel rank's conv1d and per-head parameters."""
        hg, p, n, r, hv = self.hg, self.p, self.n, self.r, self.hv
        conv, heads = [], []
        for v in range(self.rank * self.here, (self.rank + 1) * self.here):
            group, piece = divmod(v, r)
            base = group * (hg * p + 2 * n)  # the group's channels: x (hg p), B, C
            x = base + piece * hv * p
            conv += [
                torch.arange(x, x + hv * p),
                torch.arange(base + hg * p, base + hg * p + 2 * n),
            ]
            first = group * hg + piece * hv
            heads.append(torch.arange(first, first + hv))
        return torch.cat(conv), torch.cat(heads)
