"""Qwen3.5 (model_type "qwen3_5_text", Qwen3_5ForCausalLM: the text model of Qwen3.5, dense):
Qwen3-Next's layers (qwen3_next.py: gated DeltaNets where layer_types says, gated softmax
attention, zero-centred norms, a partial rotation, the multi-token prediction module of the
released weights) with a dense SwiGLU MLP in every layer, and the DeltaNet's input
projections saved apart rather than interleaved per key head:

Hugging Face (model.layers.{i}.linear_attn.)    mp (decoder.layers.{i}.self_attention.)
    in_proj_qkv.weight [2 Hk dk + Hv dv, h]       in_proj.{query,key,value}.weight
        all query rows, then the keys', then        [Hk, dk | dk | r dv, h]
        the values' (value head j of key head
        j // r)
    in_proj_z.weight [Hv dv, h]                   in_proj.z.weight [Hk, r dv, h]
    in_proj_b.weight, in_proj_a.weight [Hv, h]    in_proj.beta.weight, alpha.weight [Hk, r, h]

Hk key heads of dk channels, Hv = r Hk value heads of dv channels. Its rotary embeddings are
Qwen3-VL's multimodal ones (mrope_section), which rotate text, whose three position axes
are one, as plain RoPE: mrope_section and mrope_interleaved in rope_parameters are read
as nothing and written back. qwen3_5_moe_text.py adds the experts; the image-and-text
model_types "qwen3_5" and "qwen3_5_moe" are refused (their text models convert alone).
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import base_config
from mp_ckpt.families.llama_style import dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.qwen3_next import (
    ATTENTION_RULES,
    DELTA_NET_RULES,
    MTP_RULES,
    check_layers,
    held,
    layer_keys,
    layer_settings,
)
from mp_ckpt.families.table import Dims, Family, Rule

__all__ = ["FAMILY", "LAYER_RULES", "qwen3_5_keys", "qwen3_5_settings"]

_DEFAULTS = {"intermediate_size": 12288, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32}  # fmt: skip
"""transformers' Qwen3_5TextConfig defaults, for a key config.json omits."""

_MROPE = ("mrope_section", "mrope_interleaved")


def _qkv_to_mp(t, dims: Dims) -> list[torch.Tensor]:
    """[q (Hk dk); k (Hk dk); v (Hv dv), h] -> mp's [Hk, rows of a key head, h] each."""
    hk, dk, vd = dims.linear_key_heads, dims.linear_key_dim, dims.linear_value_dim
    parts = t[0].split([hk * dk, hk * dk, dims.linear_value_heads * vd])
    return [part.reshape(hk, -1, part.shape[-1]) for part in parts]


def _by_key_head(t, dims: Dims) -> list[torch.Tensor]:
    """[Hv x rows, h] -> mp's [Hk, r x rows, h] (value head j is key head j // r's)."""
    return [t[0].reshape(dims.linear_key_heads, -1, t[0].shape[-1])]


def _flat(t, dims: Dims) -> list[torch.Tensor]:
    return [torch.cat([part.reshape(-1, part.shape[-1]) for part in t])]


_LIN = "model.layers.{i}.linear_attn."
_IN = "self_attention.in_proj"
IN_PROJ_RULES = (
    Rule(tuple(f"{_IN}.{p}.weight" for p in ("query", "key", "value")), _LIN + "in_proj_qkv.weight",
         "linear_attention", to_mp=_qkv_to_mp, to_hf=_flat, megatron=_IN),
    *(Rule((f"{_IN}.{ours}.weight",), f"{_LIN}in_proj_{theirs}.weight", "linear_attention",
           to_mp=_by_key_head, to_hf=_flat, megatron=_IN)
      for ours, theirs in (("z", "z"), ("beta", "b"), ("alpha", "a"))),
)  # fmt: skip
"""Qwen3.5's DeltaNet input projections, apart."""
LAYER_RULES = (*MTP_RULES, *ATTENTION_RULES, *IN_PROJ_RULES, *DELTA_NET_RULES)
"""Every Qwen3.5 layer's rules but its MLP's."""
RULES = (*model_rules(), *norm_rules(), *dense_mlp_rules(), *LAYER_RULES)


def _text_config(config: dict) -> dict:
    """config.json without rope_parameters' multimodal keys (read as plain RoPE)."""
    rope = {k: v for k, v in (config.get("rope_parameters") or {}).items() if k not in _MROPE}
    return config | {"rope_parameters": rope}


def qwen3_5_settings(config: dict, defaults: dict) -> dict:
    """The settings of Qwen3.5's layers but their MLPs, its multimodal rotary keys kept
    (as hf_mrope_section, hf_mrope_interleaved) to be written back."""
    rope = config.get("rope_parameters") or {}
    kept = {"hf_" + key: rope[key] for key in _MROPE if key in rope}
    return layer_settings(_text_config(config), defaults) | kept


def qwen3_5_keys(settings: dict, model_type: str, layers: int, rope_parameters: dict) -> dict:
    """config.json's keys of qwen3_5_settings."""
    check_layers(settings, model_type)
    keys = layer_keys(settings, layers, rope_parameters)
    mrope = {key: settings["hf_" + key] for key in _MROPE if "hf_" + key in settings}
    keys["rope_parameters"] |= mrope
    return keys


def _settings(config: dict) -> dict:
    return qwen3_5_settings(config, _DEFAULTS)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "qwen3_5_text", qk_layernorm=True,
                         apply_layernorm_1p=True,
                         rotary_percent=settings.get("rotary_percent", 1.0))  # fmt: skip
    keys = qwen3_5_keys(settings, "qwen3_5_text", shapes["layers"], config["rope_parameters"])
    return config | keys | {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "use_cache": True,
    }  # fmt: skip


FAMILY = Family("qwen3_5_text", "Qwen3_5ForCausalLM", RULES, _settings, _config, held=held,
                mtp_sublayer=("model.layers.{i}.", "mtp.layers.{i}."))  # fmt: skip
