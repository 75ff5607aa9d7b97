"""Granite (model_type "granite", GraniteForCausalLM: IBM's Granite 3.x dense models):
Llama's layers and tensors with four scales, each an mp setting:

    embedding_multiplier    word_embedding_multiplier: the embeddings' output times it
    attention_multiplier    the softmax scale itself: query_pre_attn_scalar 1 / m^2 (1/128
                            is 16384), refused where that is not an integer giving m back
    residual_multiplier     residual_multiplier: each sublayer's output times it
    logits_scaling          logits_scaling: the logits divided by it

Refused besides Llama's: attention_bias, mlp_bias.
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama import RULES
from mp_ckpt.families.table import Family

__all__ = ["FAMILY", "scale_keys", "scale_settings"]

_SCALES = ("word_embedding_multiplier", "residual_multiplier", "logits_scaling")
_KEYS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
"""config.json's keys of _SCALES, in order."""


def _scalar(multiplier: float) -> int:
    """query_pre_attn_scalar of a softmax scale (attention_multiplier)."""
    scalar = round(multiplier**-2)
    if scalar < 1 or scalar**-0.5 != multiplier:
        raise ValueError(
            f"config.json attention_multiplier={multiplier!r}: mp scales attention by "
            "1 / sqrt(an integer) (query_pre_attn_scalar), which gives no exactly this"
        )
    return scalar


def scale_settings(config: dict) -> dict:
    """The settings of config.json's four scales (the module docstring; Granite's MoE and
    hybrid families have them too)."""
    scales = {ours: float(config.get(key, 1.0)) for ours, key in zip(_SCALES, _KEYS, strict=True)}
    return scales | {"query_pre_attn_scalar": _scalar(config.get("attention_multiplier", 1.0))}


def scale_keys(settings: dict) -> tuple[dict, dict]:
    """(the settings the scales are, to accept in check_computes; config.json's four
    keys)."""
    scalar = settings.get("query_pre_attn_scalar")
    if scalar is None:
        raise ValueError("model_config query_pre_attn_scalar=None: Granite's configs give the "
                         "softmax scale (attention_multiplier)")  # fmt: skip
    scales = {name: settings.get(name, 1.0) for name in _SCALES}
    keys = {key: float(scales[ours]) for ours, key in zip(_SCALES, _KEYS, strict=True)}
    keys["attention_multiplier"] = scalar**-0.5
    return scales | {"query_pre_attn_scalar": scalar}, keys


def _settings(config: dict) -> dict:
    base = llama_settings(config, rms_norm_eps=1e-6, max_positions=2048)
    return base | scale_settings(config)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    computes, keys = scale_keys(settings)
    config = base_config(settings, shapes, tokens, dtype, "granite", **computes)
    config = head_dim_where_it_differs(config, shapes)  # GraniteConfig has none
    return config | keys | {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite",
        "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


FAMILY = Family("granite", "GraniteForCausalLM", RULES, _settings, _config)
