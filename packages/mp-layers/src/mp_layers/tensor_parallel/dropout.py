"""Dropout inside tensor-parallel regions: which random stream to draw from.

Shapes: [s, b, h] = sequence, batch, hidden; x/tp is this rank's piece.

A dropout mask must be independent across the pieces of a sharded
activation and identical across the copies of a replicated one:

- sharded over TP ([s, b, h/tp] attention probabilities or MLP activations
  per head/feature group, or [s/tp, b, h] under sequence parallelism): each
  rank's piece is a different part of the global tensor, so its mask must
  differ from the other ranks'. Draw from mp-state's tensor-parallel stream,
  seeded seed + 2718 + tp_rank: `tensor_parallel_dropout` below, or any
  random op inside `with tracker.fork(TENSOR_PARALLEL_RNG):`.
- replicated on the TP ranks ([s, b, h] after a row-parallel all-reduce
  without sequence parallelism): every rank holds the same values and must
  drop the same ones, so plain F.dropout on the default generator, which
  the TP ranks of a stage share (mp_state.set_random_seeds).

The tracker's states are part of the RNG checkpoint (mp_state.get_rng_state),
and activation recomputation restores them with tracker.get_states() /
set_states() before re-running the forward, so the masks are reproduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker

__all__ = ["tensor_parallel_dropout"]


def tensor_parallel_dropout(
    x: torch.Tensor,
    p: float,
    tracker: RNGStatesTracker,
    *,
    training: bool = True,
) -> torch.Tensor:
    """F.dropout(x, p) with the mask drawn from the tensor-parallel stream of `tracker`.

    For activations sharded over the TP ranks: each rank draws a different
    mask, and the default generator is left where it was.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p={p!r} must be in [0, 1]")
    if not training or p == 0.0:
        return x
    with tracker.fork(TENSOR_PARALLEL_RNG):
        return F.dropout(x, p, training=True)
