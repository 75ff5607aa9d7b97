"""The hidden dropout of a sublayer's output before its residual add.

It acts on replicated activations without sequence parallelism (the default stream:
every TP rank draws the same mask) and on sharded ones with it (the tensor-parallel
stream: each rank draws for its own slice).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mp_layers.config import TransformerConfig
from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker

__all__ = ["check_dropout_stream", "hidden_dropout"]


def hidden_dropout(
    config: TransformerConfig, rng_tracker: RNGStatesTracker | None, x: torch.Tensor,
    training: bool,
) -> torch.Tensor:  # fmt: skip
    """x after config.hidden_dropout (x itself when not training or p = 0)."""
    p = config.hidden_dropout
    if not training or p == 0:
        return x
    sharded = config.sequence_parallel
    stream = rng_tracker.fork(TENSOR_PARALLEL_RNG) if sharded else contextlib.nullcontext()
    with stream:
        return F.dropout(x, p=p, training=True)


def check_dropout_stream(config: TransformerConfig, rng_tracker: RNGStatesTracker | None) -> None:
    """Hidden dropout under sequence parallelism draws from the tracker's tensor-parallel
    stream: a layer built without a tracker would fail at its first forward."""
    if config.hidden_dropout > 0 and config.sequence_parallel and rng_tracker is None:
        raise ValueError("hidden_dropout with sequence_parallel needs an rng_tracker")
