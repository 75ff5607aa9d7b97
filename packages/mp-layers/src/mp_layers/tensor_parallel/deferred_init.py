"""Tensor-parallel weights initialized later, a few rows at a time: the ones a rank keeps
of them under fully sharded data parallelism.

Under `deferred_weights()` (ZeRO-3 with --init-model-with-meta-device, while a
transformer layer is built) the parallel linear layers create their weights on the meta
device, and init_partitioned_weight records a recipe on each (`DeferredInit`: the master
shape, the partition dimension, this rank's place in the tensor-parallel group, the init
method and the default CPU generator's state) instead of filling it. It still advances
the generator exactly as the whole draw would, so every later weight draws what it draws
today. Once the layer is sharded, `fill_rows(recipe, start, stop, out)` writes rows
[start, stop) of this rank's tensor-parallel piece into `out` (the rank's shard), replaying
the draw from the recorded state.

Neither step holds the master: both draw it in blocks of rows. torch's CPU `normal_`
fills a contiguous tensor of at least 16 elements with one uniform number per element,
in order, transformed in groups of 16, and redraws the last 16 when the count is not a
multiple of 16. Blocks whose sizes are multiples of 16 (the last one at least 16) draw
the same numbers as the whole tensor and leave the generator in the same state. Init
methods that are `functools.partial(torch.nn.init.normal_, ...)` are drawn so, and so are
`GatedRows` (a fused gate/up weight: rows of one logical draw, reordered per rank) and
`RowOrder` (any reordering of a logical draw's rows); any other is drawn whole (in one
scratch master per weight), which gives the same values.

Other weights drawn with `normal_` follow the same pattern with recipes of their own
(`attach`): the MoE router's weight goes through init_partitioned_weight (not split), and
GroupedExperts replays its expert-by-expert draws with `normal_blocks`. Small tensors are
built as before (norms, biases, attention sinks, the shared experts' gate [1, h], the
router's bias) and sharded like any parameter.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = [
    "DeferredInit",
    "GatedRows",
    "RowOrder",
    "attach",
    "deferred_weights",
    "deferring",
    "fill_rows",
    "normal_blocks",
    "weight_device",
]

_BLOCK_ELEMENTS = 1 << 16
"""At most this many elements per drawn block (256 KiB in fp32), fewer for small weights."""

_deferred: ContextVar[bool] = ContextVar("deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights(enabled: bool = True) -> Iterator[None]:
    """Inside, the parallel linear layers' weights are created on the meta device and
    init_partitioned_weight records how to fill them (DeferredInit)."""
    token = _deferred.set(enabled)
    try:
        yield
    finally:
        _deferred.reset(token)


def deferring() -> bool:
    """Whether weights are being deferred (inside deferred_weights())."""
    return _deferred.get()


def weight_device(device: torch.device | str | None) -> torch.device | str | None:
    """Where a parallel layer creates its weight: meta under deferred_weights()."""
    return "meta" if _deferred.get() else device


@dataclass(frozen=True)
class DeferredInit:
    """How to draw a weight left on the meta device (module docstring)."""

    master_shape: tuple[int, ...]
    partition_dim: int | None
    rank: int
    """This rank's place in the tensor-parallel group."""
    piece: int
    """The size of this rank's piece along partition_dim."""
    init_method: Callable[[torch.Tensor], object]
    generator_state: torch.Tensor
    """The default CPU generator's state before the draw."""

    def fill_rows(self, start: int, stop: int, out: torch.Tensor,
                  through: torch.dtype | None = None) -> None:  # fmt: skip
        """fill_rows(self, ...): the protocol mp_optim's FSDP sharding calls."""
        fill_rows(self, start, stop, out, through)


def record(weight: torch.Tensor, master_shape, partition_dim, rank: int, init_method) -> None:
    """Records weight's recipe (weight: a meta tensor of this rank's piece's shape) and
    advances the default CPU generator past the master's draw."""
    piece = weight.shape[partition_dim] if partition_dim is not None else 0
    attach(weight, DeferredInit(
        tuple(master_shape), partition_dim, rank, piece, init_method, torch.get_rng_state()
    ))  # fmt: skip
    for _ in _blocks(tuple(master_shape), _plain(init_method), None):
        pass


def attach(weight: torch.Tensor, recipe) -> None:
    """Marks `weight` (on the meta device) as filled later by `recipe`: any object with
    fill_rows(start, stop, out, through) writing rows [start, stop) of the weight (the
    protocol mp_optim's FSDP sharding calls)."""
    weight._mp_deferred_init = recipe


def fill_rows(recipe: DeferredInit, start: int, stop: int, out: torch.Tensor,
              through: torch.dtype | None = None) -> None:  # fmt: skip
    """out[: stop - start] = rows [start, stop) of this rank's piece of the master (fp32,
    rounded to `through` first when given, as a parameter of that dtype would hold it)."""
    dim = recipe.partition_dim
    offset = recipe.rank * recipe.piece if dim == 0 else 0
    segments = _drawn_rows(recipe.init_method, recipe.master_shape[0], start + offset,
                           stop + offset)  # fmt: skip
    left = stop - start
    init_method = _plain(recipe.init_method)
    for begin, block in _blocks(recipe.master_shape, init_method, recipe.generator_state):
        if not left:
            break  # the rest of the master is not needed
        for drawn, end, at in segments:  # drawn rows [drawn, end) go to out[at:]
            lo, hi = max(begin, drawn), min(begin + block.shape[0], end)
            if lo >= hi:
                continue
            rows = block[lo - begin : hi - begin]
            if dim is not None and dim != 0:
                rows = rows.narrow(dim, recipe.rank * recipe.piece, recipe.piece)
            if through is not None:
                rows = rows.to(through)
            out[at + lo - drawn : at + hi - drawn].copy_(rows)
            left -= hi - lo


class GatedRows:
    """The init method of a fused gated weight [2f, h] split over tp ranks by rows: the
    weight is drawn as one logical [2f, h] matrix (rows 0..f-1 the gate, f..2f-1 the up
    projection), and rank r's contiguous rows hold [gate_r; up_r]."""

    def __init__(self, init: Callable[[torch.Tensor], object], tp: int) -> None:
        self.init, self.tp = init, tp

    def __call__(self, master: torch.Tensor) -> None:
        logical = torch.empty_like(master)
        self.init(logical)
        gate, up = logical.chunk(2, dim=0)
        pieces = [torch.cat([g, u]) for g, u in zip(gate.chunk(self.tp), up.chunk(self.tp),
                                                    strict=True)]  # fmt: skip
        master.copy_(torch.cat(pieces))

    def logical_rows(self, rows: int, first: int, last: int) -> list[tuple[int, int, int]]:
        """(drawn start, drawn end, offset from `first`) of the master's rows [first, last)."""
        half = rows // 2 // self.tp  # rows of gate (and of up) per rank
        segments = []
        row = first
        while row < last:
            rank, inside = divmod(row, 2 * half)
            part, index = divmod(inside, half)  # part 0: gate, 1: up
            count = min(half - index, last - row)
            drawn = part * (rows // 2) + rank * half + index
            segments.append((drawn, drawn + count, row - first))
            row += count
        return segments


class RowOrder:
    """The init method of a weight whose master holds the rows of one logical draw in
    another order: master row j is row order[j] of `init`'s draw (a query group shared
    by tensor-parallel ranks: transformer/shared_query_groups.py)."""

    def __init__(self, init: Callable[[torch.Tensor], object], order: torch.Tensor) -> None:
        self.init, self.order = init, order

    def __call__(self, master: torch.Tensor) -> None:
        self.init(master)
        with torch.no_grad():
            master.copy_(master[self.order.to(master.device)])

    def logical_rows(self, rows: int, first: int, last: int) -> list[tuple[int, int, int]]:
        """(drawn start, drawn end, offset from `first`) of the master's rows [first, last)."""
        drawn = self.order[first:last].tolist()
        segments, at = [], 0
        while at < len(drawn):
            end = at + 1
            while end < len(drawn) and drawn[end] == drawn[end - 1] + 1:
                end += 1
            segments.append((drawn[at], drawn[end - 1] + 1, at))
            at = end
        return segments


def _drawn_rows(init_method, rows: int, first: int, last: int) -> list[tuple[int, int, int]]:
    """Which rows of the draw the master's rows [first, last) are (fill_rows' segments)."""
    if isinstance(init_method, GatedRows | RowOrder):
        return init_method.logical_rows(rows, first, last)
    return [(first, last, 0)]


def _plain(init_method):
    """The init method the rows are drawn with (a reordered layout's logical one)."""
    return init_method.init if isinstance(init_method, GatedRows | RowOrder) else init_method


def _blocks(shape: tuple[int, ...], init_method,
            state: torch.Tensor | None) -> Iterator[tuple[int, torch.Tensor]]:  # fmt: skip
    """(first row, block) over the master's rows, drawn as the whole master's draw draws
    them: from the default generator (state None) or from a generator in `state`. Each
    block is valid until the next one is drawn."""
    normal = _normal_arguments(init_method)
    if normal is None:  # drawn whole, as init_partitioned_weight does
        master = torch.empty(shape)
        if state is None:
            init_method(master)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(state)
                init_method(master)
        yield 0, master
        return
    generator = None
    if state is not None:
        generator = torch.Generator()
        generator.set_state(state)
    yield from normal_blocks(shape, *normal, generator)


def normal_blocks(
    shape: tuple[int, ...], mean: float, std: float, generator: torch.Generator | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, block) over the rows of `torch.empty(shape).normal_(mean, std)` drawn
    from `generator` (None: the default CPU generator): the same numbers, and the
    generator left in the same state, a block of rows at a time (module docstring). Each
    block is valid until the next one is drawn."""
    rows, width = shape[0], math.prod(shape[1:])
    if rows * width < 16:  # drawn one number at a time: whole (and small)
        yield 0, torch.empty(shape).normal_(mean, std, generator=generator)
        return
    step = 16 // math.gcd(width, 16)  # rows whose elements are a multiple of 16
    per_block = max(step, min(_BLOCK_ELEMENTS // width, rows // 16) // step * step)
    scratch = torch.empty(min(per_block, rows), *shape[1:])
    begin = 0
    while begin < rows:
        count = min(per_block, rows - begin)
        if 0 < (rows - begin - count) * width < 16:
            count = rows - begin  # a tail under 16 elements joins this block
            scratch = torch.empty(count, *shape[1:])
        block = scratch[:count]
        block.normal_(mean, std, generator=generator)
        yield begin, block
        begin += count


def _normal_arguments(init_method) -> tuple[float, float] | None:
    """(mean, std) of a functools.partial of torch.nn.init.normal_ with keywords, else None."""
    if not isinstance(init_method, functools.partial) or init_method.args:
        return None
    keywords = init_method.keywords
    if init_method.func is not torch.nn.init.normal_ or set(keywords) - {"mean", "std"}:
        return None
    return float(keywords.get("mean", 0.0)), float(keywords.get("std", 1.0))
