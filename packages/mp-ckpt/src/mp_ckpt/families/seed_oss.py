"""Seed-OSS (model_type "seed_oss", SeedOssForCausalLM; ByteDance's Seed-OSS-36B): Llama's
layers with q, k and v biases where attention_bias says (on by default, as in the released
model), its own head dim, and dropout after each sublayer (residual_dropout: mp's
hidden_dropout) besides the attention's (attention_dropout). Its tensors are Llama's and
Qwen2's names (llama_style.py).

Refused besides Llama's: attention_out_bias (an o_proj bias without MLP biases, which
Megatron's one add_bias_linear switch does not express; the released model has none).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

RULES = (*model_rules(), *attention_rules(qkv_bias=None), *norm_rules(), *dense_mlp_rules())
_DROPOUT = 0.1
"""SeedOssConfig's attention_dropout and residual_dropout."""


def _settings(config: dict) -> dict:
    refuse(config, "attention_out_bias", False)
    plain = {k: v for k, v in config.items() if k != "attention_bias"}
    plain["attention_dropout"] = config.get("attention_dropout", _DROPOUT)
    base = llama_settings(plain, rope_theta=10000.0, rms_norm_eps=1e-6, max_positions=524288)
    return base | {
        "add_qkv_bias": bool(config.get("attention_bias", True)),
        "hidden_dropout": config.get("residual_dropout", _DROPOUT),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "seed_oss")
    return config | {
        "architectures": ["SeedOssForCausalLM"], "model_type": "seed_oss",
        "attention_bias": bool(settings.get("add_qkv_bias")), "attention_out_bias": False,
        "mlp_bias": False, "residual_dropout": settings.get("hidden_dropout", 0.0),
        "pretraining_tp": 1,
    }  # fmt: skip


FAMILY = Family("seed_oss", "SeedOssForCausalLM", RULES, _settings, _config)
