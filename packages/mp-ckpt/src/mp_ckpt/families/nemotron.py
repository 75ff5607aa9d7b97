"""Nemotron dense (model_type "nemotron", NemotronForCausalLM; Nemotron-Mini-4B): LayerNorm
with biases whose weight is stored centred on zero (the norm multiplies by 1 + w:
Megatron's --apply-layernorm-1p), squared ReLU in an ungated MLP (up_proj, down_proj;
--squared-relu), rotary embeddings on the first partial_rotary_factor of each head's
channels (--rotary-percent), no linear biases, grouped-query attention."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

RULES = (*model_rules(norm_bias=True), *attention_rules(), *norm_rules(bias=True),
         *dense_mlp_rules(gated=False))  # fmt: skip


def _settings(config: dict) -> dict:
    refuse(config, "hidden_act", "relu2")
    rope = dict(config.get("rope_parameters") or {})
    partial = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    llama_style = config | {"hidden_act": "silu", "rope_parameters": rope,
                            "rms_norm_eps": config.get("norm_eps", 1e-5)}  # fmt: skip
    base = llama_settings(llama_style, max_positions=4096)
    return base | {
        "normalization": "LayerNorm", "apply_layernorm_1p": True, "activation": "squared_relu",
        "rotary_percent": float(partial),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    partial = settings.get("rotary_percent", 1.0)
    config = base_config(settings, shapes, tokens, dtype, "nemotron", normalization="LayerNorm",
                         apply_layernorm_1p=True, activation="squared_relu",
                         rotary_percent=partial)  # fmt: skip
    config["norm_eps"] = config.pop("rms_norm_eps")
    config["rope_parameters"] = {"partial_rotary_factor": partial, **config["rope_parameters"]}
    return config | {
        "architectures": ["NemotronForCausalLM"], "model_type": "nemotron",
        "hidden_act": "relu2", "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


FAMILY = Family("nemotron", "NemotronForCausalLM", RULES, _settings, _config)
