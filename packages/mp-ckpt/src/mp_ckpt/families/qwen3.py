"""Qwen3 dense (model_type "qwen3", Qwen3ForCausalLM): Llama's layers with an RMSNorm
over each query and key head (q_norm, k_norm: Megatron's --qk-layernorm) and a head
dim of its own (head_dim 128 where hidden / heads is not)."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.qwen_windows import qwen_window_keys, refuse_qwen_windows
from mp_ckpt.families.table import Family

__all__ = ["FAMILY", "qwen3_settings"]

RULES = (*model_rules(), *attention_rules(qkv_bias=None, qk_norm=True), *norm_rules(),
         *dense_mlp_rules())  # fmt: skip


def qwen3_settings(config: dict, max_positions: int = 32768) -> dict:
    """Settings of Qwen3's attention (Qwen3 and Qwen3-MoE): qk-layernorm, optional
    q/k/v biases (attention_bias)."""
    refuse_qwen_windows(config)
    bias = bool(config.get("attention_bias", False))
    unbiased = {k: v for k, v in config.items() if k != "attention_bias"}
    base = llama_settings(unbiased, rope_theta=10000.0, max_positions=max_positions)
    return base | {"qk_layernorm": True, "add_qkv_bias": bias}


def qwen3_keys(settings: dict) -> dict:
    if not settings.get("qk_layernorm"):
        raise ValueError("model_config qk_layernorm=False: Qwen3 normalizes queries and keys")
    return qwen_window_keys(settings) | {"attention_bias": bool(settings.get("add_qkv_bias"))}


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "qwen3", qk_layernorm=True)
    return (
        config
        | qwen3_keys(settings)
        | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    )


FAMILY = Family("qwen3", "Qwen3ForCausalLM", RULES, qwen3_settings, _config)
