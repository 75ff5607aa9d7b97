"""A callback for every transformer layer as soon as it is built.

    with on_layer_built(shard):  # e.g. shard each layer before the next one is built
        model = GPTModel(...)

TransformerBlock and the multi-token prediction modules hand each
TransformerLayer to the callback right after constructing it. The callback
must draw nothing from the default generator (for an MTP module it runs
inside the module's seeded initialization, before its final norm is built).
Fully sharded data parallelism uses it to keep one layer whole at a time
while a chunk is built. Without a callback nothing happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

__all__ = ["layer_built", "on_layer_built"]

_callback: ContextVar[Callable[[torch.nn.Module], None] | None] = ContextVar(
    "layer_built_callback", default=None
)


@contextlib.contextmanager
def on_layer_built(callback: Callable[[torch.nn.Module], None]) -> Iterator[None]:
    """Calls `callback(layer)` for each transformer layer built inside the block."""
    token = _callback.set(callback)
    try:
        yield
    finally:
        _callback.reset(token)


def layer_built(layer: torch.nn.Module) -> torch.nn.Module:
    """Hands `layer`, just built, to the callback in force (if any); returns it."""
    callback = _callback.get()
    if callback is not None:
        callback(layer)
    return layer
