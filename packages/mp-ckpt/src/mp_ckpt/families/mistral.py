"""Mistral (model_type "mistral", MistralForCausalLM): Llama's layers and names, with a
sliding attention window (sliding_window: a query sees itself and the sliding_window - 1
positions before it: mp's window_size (sliding_window - 1, 0)); null attends to all."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama import RULES
from mp_ckpt.families.table import Family
from mp_ckpt.families.window import sliding_window, window_size

__all__ = ["FAMILY"]


def _settings(config: dict) -> dict:
    base = llama_settings(config, rope_theta=10000.0, rms_norm_eps=1e-6, max_positions=4096 * 32)
    return base | window_size(config.get("sliding_window"))


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    window = settings.get("window_size")
    config = base_config(settings, shapes, tokens, dtype, "mistral",
                         window_size=tuple(window) if window else None)  # fmt: skip
    return config | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                     "sliding_window": sliding_window(settings, shapes["layers"])}  # fmt: skip


FAMILY = Family("mistral", "MistralForCausalLM", RULES, _settings, _config)
