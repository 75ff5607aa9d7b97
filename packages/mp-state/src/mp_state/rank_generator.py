"""Rank groups on the parallel grid, with megatron-core's RankGenerator semantics.

The world is a grid with one axis per parallelism: tp, cp, ep, dp, pp. The
order string names the axes from the fastest-varying to the slowest, so with
the default "tp-cp-ep-dp-pp" consecutive ranks share a data-parallel replica
and differ in tensor-parallel rank:

    rank = sum(coord[axis] * stride[axis]),  stride[first axis] = 1,
    stride[next] = stride[previous] * size[previous].

A token such as "tp-dp" asks for the groups in which every axis of the token
varies and every other axis is fixed. Groups are listed with the first fixed
axis varying fastest; inside a group, ranks follow the order string (not the
token), again fastest axis first. This is exactly what megatron-core's
RankGenerator returns, so cluster layouts planned here match Megatron's.

Pure Python: no process group is needed, so this also plans layouts for
clusters that are not there.
"""

from __future__ import annotations

import itertools
import math

__all__ = ["AXES", "RankGenerator", "parse_order"]

AXES = ("tp", "cp", "ep", "dp", "pp")
"""The axes of the parallel grid, in the default order."""


def parse_order(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Checks an order string against the sizes and returns its full axis list.

    Axes of size 1 that the order leaves out are appended at the end (slowest),
    as megatron-core does; a size > 1 left out is an error, as are unknown and
    repeated tokens.
    """
    tokens = tuple(order.lower().split("-"))
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(
            f"order={order!r} has unknown token(s) {unknown}; tokens are {'-'.join(AXES)}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order={order!r} repeats token(s) {repeated}")
    missing = [f"{a}={sizes[a]}" for a in AXES if a not in tokens and sizes[a] > 1]
    if missing:
        raise ValueError(
            f"order={order!r} leaves out {', '.join(missing)}: every size > 1 must be in the order"
        )
    return tokens + tuple(a for a in AXES if a not in tokens)


class RankGenerator:
    """Lists the rank groups of one parallel grid (megatron-core semantics).

    megatron-core builds two of these over the same order: one for dense
    layers (ep=1) and one for expert layers (tp=expert_tp, ep, dp=expert_dp,
    cp=1). One generator cannot have both ep > 1 and cp > 1.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        self.sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for axis, size in self.sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}={size!r} must be a positive integer")
        if ep > 1 and cp > 1:
            raise ValueError(
                f"ep={ep} and cp={cp} are both > 1 in one RankGenerator: context parallelism "
                "belongs to the dense generator (ep=1) and expert parallelism to the expert "
                "generator (cp=1)"
            )
        if rank_offset < 0:
            raise ValueError(f"rank_offset={rank_offset} must be >= 0")
        self.rank_offset = rank_offset
        self.axes = parse_order(order, self.sizes)
        self.order = "-".join(self.axes)
        self.world_size = math.prod(self.sizes.values())
        self._strides = {}
        stride = 1
        for axis in self.axes:
            self._strides[axis] = stride
            stride *= self.sizes[axis]

    def get_ranks(self, token: str) -> list[list[int]]:
        """The groups in which the token's axes vary (e.g. "tp", "tp-dp", "dp-cp")."""
        wanted = token.lower().split("-")
        bad = [t for t in wanted if t not in self.axes]
        if bad:
            raise ValueError(f"token={token!r} names axes {bad} not in order {self.order!r}")
        varying = [a for a in self.axes if a in wanted]
        fixed = [a for a in self.axes if a not in wanted]
        return [
            [self.rank_offset + base + offset for offset in self._offsets(varying)]
            for base in self._offsets(fixed)
        ]

    def _offsets(self, axes: list[str]) -> list[int]:
        """Rank offsets of every coordinate over `axes`, the first axis fastest."""
        # itertools.product varies its last argument fastest, so feed it reversed.
        ranges = [range(self.sizes[a]) for a in reversed(axes)]
        strides = [self._strides[a] for a in reversed(axes)]
        return [
            sum(c * s for c, s in zip(coord, strides, strict=True))
            for coord in itertools.product(*ranges)
        ]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in self.axes)
        return f"RankGenerator({sizes}, order={self.order!r}, rank_offset={self.rank_offset})"
