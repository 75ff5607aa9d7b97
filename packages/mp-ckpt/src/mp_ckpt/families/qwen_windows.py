"""Qwen2's and Qwen3's sliding-window keys (use_sliding_window, sliding_window,
max_window_layers): the families share them and mp computes only their absence."""

from __future__ import annotations

__all__ = ["QWEN_MAX_WINDOW_LAYERS", "qwen_window_keys", "refuse_qwen_windows"]

QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default; unused without a sliding window


def refuse_qwen_windows(config: dict) -> None:
    if config.get("use_sliding_window"):
        raise ValueError(
            "config.json use_sliding_window=True: Qwen's window (layers from "
            "max_window_layers on) is not computed by mp; only use_sliding_window=false"
        )
    kinds = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        raise ValueError(f"config.json layer_types={kinds!r}: mp computes only 'full_attention' "
                         "layers for this family")  # fmt: skip


def qwen_window_keys(settings: dict) -> dict:
    if settings.get("window_size"):
        raise ValueError(f"model_config window_size={settings['window_size']!r}: Qwen's "
                         "config.json has no window on every layer")  # fmt: skip
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": QWEN_MAX_WINDOW_LAYERS}  # fmt: skip
