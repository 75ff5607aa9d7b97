"""GLM-4 dense (model_type "glm4", Glm4ForCausalLM: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1):
Llama's attention with q/k/v biases (attention_bias), the first partial_rotary_factor of
each head rotated in neighbouring pairs (rotary_percent with rotary_interleaved), the gate
and up projections fused in gate_up_proj (Phi-3's), and each sublayer normalized before
and after (sandwich norms: sublayer_norm "both", plain RMSNorm weights).

Hugging Face (model.layers.{i}.)        mp (decoder.layers.{i}.)
    self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight   as Qwen2's
    mlp.gate_up_proj.weight, mlp.down_proj.weight                   as Phi-3's
    input_layernorm.weight              input_layernorm.weight
    post_self_attn_layernorm.weight     post_self_attn_layernorm.weight
    post_attention_layernorm.weight     pre_mlp_layernorm.weight
    post_mlp_layernorm.weight           post_mlp_layernorm.weight

Refused besides Llama's: rope types other than default (GLM-4's configs have none).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama_style import attention_rules, fused_mlp_rules, model_rules
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY"]

_LAYER = "model.layers.{i}."
_NORMS = (("input_layernorm", "input_layernorm"),
          ("post_self_attn_layernorm", "post_self_attn_layernorm"),
          ("pre_mlp_layernorm", "post_attention_layernorm"),
          ("post_mlp_layernorm", "post_mlp_layernorm"))  # fmt: skip
RULES = (
    *model_rules(),
    *attention_rules(qkv_bias=None),
    *(Rule((f"{ours}.weight",), f"{_LAYER}{theirs}.weight") for ours, theirs in _NORMS),
    *fused_mlp_rules(),
)
_DEFAULT_PARTIAL = 0.5
"""Glm4Config's partial_rotary_factor."""


def _settings(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    partial = rope.pop("partial_rotary_factor",
                       config.get("partial_rotary_factor", _DEFAULT_PARTIAL))  # fmt: skip
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json rope_type={kind!r}: mp converts GLM-4 models with "
                         "rope_type 'default'")  # fmt: skip
    plain = {k: v for k, v in config.items() if k != "attention_bias"} | {"rope_parameters": rope}
    base = llama_settings(plain, rms_norm_eps=1.5625e-07, max_positions=131072)
    return base | {
        "add_qkv_bias": bool(config.get("attention_bias", True)),
        "rotary_percent": float(partial), "rotary_interleaved": True, "sublayer_norm": "both",
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    partial = settings.get("rotary_percent", 1.0)
    config = base_config(settings, shapes, tokens, dtype, "glm4", rotary_percent=partial,
                         rotary_interleaved=True, sublayer_norm="both")  # fmt: skip
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": partial}
    return config | {
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4",
        "attention_bias": bool(settings.get("add_qkv_bias")),
    }  # fmt: skip


FAMILY = Family("glm4", "Glm4ForCausalLM", RULES, _settings, _config)
