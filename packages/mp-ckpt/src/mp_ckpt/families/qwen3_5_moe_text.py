"""Qwen3.5 MoE (model_type "qwen3_5_moe_text", Qwen3_5MoeForCausalLM: the text model of
Qwen3.5's mixture-of-experts models): qwen3_5_text.py's layers with Qwen3-Next's experts in
every layer (a softmax over all of them, the top k renormalized, beside a sigmoid-gated
shared expert; saved as Qwen2-MoE's, transformers' fused in-memory experts read too) and
the Switch load-balancing loss (router_aux_loss_coef).
"""

from __future__ import annotations

from mp_ckpt.families.llama_style import model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, shared_expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.qwen3_5_text import LAYER_RULES, qwen3_5_keys, qwen3_5_settings
from mp_ckpt.families.qwen3_next import held
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "linear_conv_kernel_dim": 4,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
"""transformers' Qwen3_5MoeTextConfig defaults, for a key config.json omits."""

RULES = (*model_rules(), *norm_rules(), *expert_rules(*_EXPERTS), *shared_expert_rules(),
         *LAYER_RULES)  # fmt: skip


def _settings(config: dict) -> dict:
    expert_ffn = positive(config, "moe_intermediate_size", _DEFAULTS)
    defaults = _DEFAULTS | {"intermediate_size": expert_ffn}  # no dense layer: unused
    layers = qwen3_5_settings(config, defaults)
    return layers | routing(config, "num_experts", _DEFAULTS) | {
        "moe_ffn_hidden_size": expert_ffn, "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": positive(
            config, "shared_expert_intermediate_size", _DEFAULTS),
        "moe_shared_expert_gate": True, "moe_layer_freq": [1],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if not all(shapes["sparse"]) or settings.get("moe_shared_expert_gate") is not True:
        raise ValueError("qwen3_5_moe_text's layers are all experts beside a gated shared "
                         "expert")  # fmt: skip
    config = moe_config(settings, shapes, tokens, dtype, "qwen3_5_moe_text", False,
                        qk_layernorm=True, apply_layernorm_1p=True,
                        rotary_percent=settings.get("rotary_percent", 1.0))  # fmt: skip
    keys = qwen3_5_keys(settings, "qwen3_5_moe_text", shapes["layers"], config["rope_parameters"])
    return config | keys | {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": shapes["expert_ffn"],
        "shared_expert_intermediate_size": shapes["shared_ffn"], "num_experts": shapes["experts"],
    }  # fmt: skip


FAMILY = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*_EXPERTS), held=held,
                mtp_sublayer=("model.layers.{i}.", "mtp.layers.{i}."))  # fmt: skip
