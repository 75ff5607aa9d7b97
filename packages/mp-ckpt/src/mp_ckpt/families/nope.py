"""Layers without rotary embeddings (NoPE) in Hugging Face's form and mp's (Llama 4's,
SmolLM3's): config.json's no_rope_layers holds 1 for a layer that rotates (else every
no_rope_layer_interval-th layer does not), mp's no_rope_freq 1 for one that does not (or
an integer N: every N-th layer, 1-based)."""

from __future__ import annotations

from mp_ckpt.families.moe_settings import positive

__all__ = ["interval_of", "layer_flags", "rotating_layers", "rotating_of"]


def layer_flags(config: dict, key: str, layers: int) -> list[int]:
    """config.json's 0/1 list `key`, one per layer (transformers reads the first
    num_hidden_layers)."""
    value = config[key]
    if not isinstance(value, list) or len(value) < layers or any(x not in (0, 1) for x in value):
        raise ValueError(
            f"config.json {key}={value!r}: expected a 0 or 1 for each of the "
            f"num_hidden_layers={layers} layers"
        )
    return [int(x) for x in value[:layers]]


def rotating_layers(config: dict, layers: int, interval: int) -> list[int]:
    """no_rope_layers (1: the layer rotates), as transformers completes it; `interval` is
    the family's no_rope_layer_interval where config.json leaves it out."""
    if config.get("no_rope_layers"):
        return layer_flags(config, "no_rope_layers", layers)
    every = positive(config, "no_rope_layer_interval", {"no_rope_layer_interval": interval})
    return [int((i + 1) % every != 0) for i in range(layers)]


def rotating_of(settings: dict, layers: int) -> list[int]:
    """no_rope_layers of mp's no_rope_freq."""
    freq = settings.get("no_rope_freq")
    if freq is None:
        return [1] * layers
    if isinstance(freq, int):
        return [int((i + 1) % freq != 0) for i in range(layers)]
    if len(freq) != layers:
        raise ValueError(f"model_config no_rope_freq={freq!r}: {layers} layers")
    return [1 - int(x) for x in freq]


def interval_of(chosen: list[int], layers: int, default: int) -> int:
    """The interval whose every-N-th layers (0-based N - 1, 2N - 1, ...) are `chosen`:
    `default` where it fits, else the smallest that does, else `default` (the explicit
    list beside it says which)."""
    fits = [n for n in range(1, layers + 1) if list(range(n - 1, layers, n)) == chosen]
    return default if default in fits or not fits else fits[0]
