"""Train / valid / test splits of one indexed dataset, as Megatron draws them.

A split string such as "969,30,1" is normalized (float64) into bookends
[(0, .969), (.969, .999), (.999, 1)]; split i covers the elements
arange(round(lo * n), round(hi * n)) as int32, where an element is a
sequence for GPT. A zero part is an empty split (None in the matrix).
"""

from __future__ import annotations

import enum
import itertools
import re

import numpy as np

__all__ = ["Split", "parse_and_normalize_split", "split_indices", "split_matrix"]


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


def parse_and_normalize_split(split: str) -> list[float]:
    """ "969,30,1" -> [0.969, 0.03, 0.001]; missing parts are 0."""
    parts = [float(p) for p in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > len(Split) or len(re.findall(r"-", split)):
        raise ValueError(
            f"split={split!r} must be 1 to {len(Split)} non-negative numbers, e.g. '969,30,1'"
        )
    parts += [0.0] * (len(Split) - len(parts))
    total = float(np.sum(np.array(parts, dtype=np.float64)))
    if total <= 0:
        raise ValueError(f"split={split!r} sums to 0: give at least one positive part")
    return [p / total for p in parts]


def split_matrix(weights: list[float]) -> list[tuple[float, float] | None]:
    """Normalized weights -> cumulative (lo, hi) bookends, None for an empty part."""
    bookends = np.cumsum([0.0, *weights], dtype=np.float64)
    return [(float(lo), float(hi)) if hi > lo else None for lo, hi in itertools.pairwise(bookends)]


def split_indices(matrix: list[tuple[float, float] | None], n: int) -> list[np.ndarray | None]:
    """The element ids of each split of a dataset of n elements."""
    result: list[np.ndarray | None] = []
    for part in matrix:
        if part is None:
            result.append(None)
            continue
        lo, hi = part
        result.append(np.arange(round(lo * n), round(hi * n), dtype=np.int32))
    return result
