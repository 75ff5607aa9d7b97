"""A callback for every transformer layer as soon as it is built.

    with on_layer_built(shard):  # e.g. shard each layer before the next one is built
        model = GPTModel(...)

TransformerBlock and the multi-token prediction modules hand each
TransformerLayer to the callback right after constructing it. The callback
must draw nothing from the default generator (for an MTP module it runs
inside the module's seeded initialization, before its final norm is built).
Fully sharded data parallelism uses it to shard each layer before the next one is
built, and with defer_weights to never hold a layer's weights whole: each rank fills
only its shard of them. Without a callback nothing happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from mp_layers.tensor_parallel.deferred_init import deferred_weights

__all__ = ["building_layer", "layer_built", "on_layer_built"]

_callback: ContextVar[Callable[[torch.nn.Module], None] | None] = ContextVar(
    "layer_built_callback", default=None
)
_defer: ContextVar[bool] = ContextVar("layer_built_defer_weights", default=False)


@contextlib.contextmanager
def on_layer_built(
    callback: Callable[[torch.nn.Module], None], *, defer_weights: bool = False
) -> Iterator[None]:
    """Calls `callback(layer)` for each transformer layer built inside the block. With
    `defer_weights` each layer's parallel linear weights are built on the meta device
    with a recipe (tensor_parallel.deferred_init) for the callback to fill once it has
    sharded them."""
    token = _callback.set(callback)
    defer = _defer.set(defer_weights)
    try:
        yield
    finally:
        _defer.reset(defer)
        _callback.reset(token)


def building_layer(sharded_later: bool = True) -> contextlib.AbstractContextManager:
    """The context a part that FSDP shards once built is constructed in (a transformer
    layer; a single stage's embedding and output layer, sharded with the chunk):
    deferred weights when the callback in force asked for them."""
    return deferred_weights(sharded_later and _callback.get() is not None and _defer.get())


def layer_built(layer: torch.nn.Module) -> torch.nn.Module:
    """Hands `layer`, just built, to the callback in force (if any); returns it."""
    callback = _callback.get()
    if callback is not None:
        callback(layer)
    return layer
