"""Sliding attention windows: Hugging Face's sliding_window and layer_types <-> Megatron's
window_size and window_attn_skip_freq.

Hugging Face's sliding_window W lets a query see itself and the W - 1 positions before
it: window_size (W - 1, 0). layer_types names each layer "sliding_attention" or
"full_attention"; window_attn_skip_freq says the same with Megatron's rule (layer
numbers from 1): an int N makes layer n full when n % N == 0, a list holds 1 for each
windowed layer. An int is written where one gives the pattern, else the list.
"""

from __future__ import annotations

__all__ = ["layer_types", "sliding_window", "window_settings", "window_size"]


def window_size(sliding: int | None) -> dict:
    """The window settings of a sliding_window (None, or W >= 1) on every layer."""
    if sliding is None:
        return {}
    if not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 1:
        raise ValueError(f"config.json sliding_window={sliding!r}: expected a positive integer")
    return {"window_size": (sliding - 1, 0)}


def window_settings(sliding: int | None, types: list[str] | None, layers: int) -> dict:
    """window_size and window_attn_skip_freq of sliding_window with layer_types."""
    if not types:
        return window_size(sliding)
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"config.json layer_types={types!r}: expected {layers} entries of "
            "'sliding_attention' or 'full_attention'"
        )
    windowed = [int(t == "sliding_attention") for t in types]
    settings = window_size(sliding)
    if not any(windowed):  # the window is kept (for the export) and no layer uses it
        return settings and settings | {"window_attn_skip_freq": windowed}
    if not settings:
        raise ValueError(
            "config.json layer_types has sliding_attention layers, sliding_window null"
        )
    if all(windowed):
        return settings
    for n in range(2, layers + 1):
        if windowed == [int((i + 1) % n != 0) for i in range(layers)]:
            return settings | {"window_attn_skip_freq": n}
    return settings | {"window_attn_skip_freq": windowed}


def _windowed(settings: dict, layers: int) -> list[bool]:
    if not settings.get("window_size"):
        return [False] * layers
    freq = settings.get("window_attn_skip_freq")
    if freq is None:
        return [True] * layers
    if isinstance(freq, int):
        return [(i + 1) % freq != 0 for i in range(layers)]
    return [bool(x) for x in freq]


def sliding_window(settings: dict, layers: int) -> int | None:
    """config.json's sliding_window of the settings (None without a window)."""
    size = settings.get("window_size")
    if not size:
        return None
    left, right = size
    if right != 0:
        raise ValueError(f"model_config window_size={tuple(size)!r}: Hugging Face's windows "
                         "are causal (right 0)")  # fmt: skip
    return int(left) + 1


def layer_types(settings: dict, layers: int) -> list[str]:
    return ["sliding_attention" if w else "full_attention" for w in _windowed(settings, layers)]
