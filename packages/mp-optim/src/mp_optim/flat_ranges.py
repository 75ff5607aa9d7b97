"""Where a model piece meets a flat range of its parameter.

A model piece (ShardedTensor) is an order-preserving view of one parameter:
the whole parameter, or a part of a fused one (q in the fused qkv weight, the
gate half of fc1). The distributed optimizer and FSDP each hold a flat range
[lo, hi) of a flattened parameter. The piece's elements inside that range are
a contiguous range [start, end) of the piece's own row-major flattening, so
the rank describes them as a flattened-range piece of the piece's box; they
sit at `positions` of the range's own 1-D tensor.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from mp_ckpt import ShardedTensor

__all__ = ["Overlap", "flat_range_piece", "locate", "overlap"]


@dataclass(frozen=True)
class Overlap:
    """The part of a piece inside a flat range."""

    start: int
    end: int
    """[start, end): the part, in the piece's flattening."""
    positions: slice | torch.Tensor
    """Where the part's elements sit in the range's 1-D tensor (a slice when contiguous)."""


def overlap(piece: ShardedTensor, numel: int, offset: int, lo: int, hi: int) -> Overlap | None:
    """The part of `piece` (a view starting at element `offset` of a parameter of `numel`
    elements) inside the parameter's flat range [lo, hi); None when they do not meet."""
    view = piece.data
    if view.is_contiguous():  # the whole parameter, or a run of whole rows of it
        first, last = max(lo, offset), min(hi, offset + view.numel())
        if first >= last:
            return None
        return Overlap(first - offset, last - offset, slice(first - lo, last - lo))
    index = torch.arange(numel).as_strided(view.size(), view.stride(), offset).reshape(-1)
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise ValueError(f"{piece.key}: the piece does not keep its parameter's element order")
    start, end = (int(i) for i in torch.searchsorted(index, torch.tensor([lo, hi])))
    if start >= end:
        return None
    return Overlap(start, end, index[start:end] - lo)


def flat_range_piece(
    key: str, piece: ShardedTensor, part: Overlap, values: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[ShardedTensor, Callable[[torch.Tensor], None]]:  # fmt: skip
    """The piece `key` describing `part` of `piece` with its values from `values` (the
    range's 1-D tensor, copied, in `dtype` if given), and the writer that puts loaded
    values back into `values`. A copy, never a view: a load fills every piece before
    any writer runs, and two pieces may describe the same memory (FSDP's shard is both
    the model's fp32 parameter and the optimizer's main parameter)."""
    flat = values.view(-1)
    data = flat[part.positions].to(dtype or flat.dtype, copy=True)

    def write(loaded: torch.Tensor) -> None:
        flat[part.positions] = loaded.to(flat.dtype)

    described = ShardedTensor(
        key, data, piece.global_shape, piece.global_offset, piece.replica_id,
        (part.start, part.end), tuple(piece.data.shape),
    )  # fmt: skip
    return described, write


def locate(
    pieces: Iterable[ShardedTensor], params: list[torch.Tensor]
) -> Iterator[tuple[ShardedTensor, torch.Tensor, int]]:
    """(piece, parameter, element offset of the piece's view in it) for every piece whose
    data lies in one of `params` (found by address; pieces of buffers, and empty ones,
    are left out)."""
    spans = sorted(
        (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i)
        for i, p in enumerate(params)
        if p.numel()
    )
    starts = [span[0] for span in spans]
    for piece in pieces:
        data = getattr(piece, "data", None)
        if not isinstance(data, torch.Tensor) or data.numel() == 0:
            continue
        ptr = data.data_ptr()
        where = bisect.bisect_right(starts, ptr) - 1
        if where < 0 or ptr >= spans[where][1]:
            continue
        param = params[spans[where][2]]
        yield piece, param, (ptr - spans[where][0]) // param.element_size()
