"""Qwen2 / Qwen2.5 (model_type "qwen2", Qwen2ForCausalLM): Llama's layers with biases on
the q, k and v projections (always: config.json has no switch for them); small sizes
tie the output layer to the embedding."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.qwen_windows import qwen_window_keys, refuse_qwen_windows
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

RULES = (*model_rules(), *attention_rules(qkv_bias=True), *norm_rules(), *dense_mlp_rules())


def _settings(config: dict) -> dict:
    refuse_qwen_windows(config)
    base = llama_settings(config, rope_theta=10000.0, rms_norm_eps=1e-6, max_positions=32768)
    return base | {"add_qkv_bias": True}


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if not settings.get("add_qkv_bias"):
        raise ValueError("model_config add_qkv_bias=False: Qwen2 always has q/k/v biases; "
                         "export it as llama")  # fmt: skip
    config = base_config(settings, shapes, tokens, dtype, "qwen2") | qwen_window_keys(settings)
    config = head_dim_where_it_differs(config, shapes)  # Qwen2 writes it only where it differs
    return config | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", RULES, _settings, _config)
