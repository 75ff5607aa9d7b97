"""Qwen3-MoE (model_type "qwen3_moe", Qwen3MoeForCausalLM): Qwen3's attention
(qk-layernorm, its own head dim), mixture-of-experts layers where decoder_sparse_step
and mlp_only_layers say (dense SwiGLU layers elsewhere), no shared expert; the top-k
weights renormalized with norm_topk_prob (as the released models set it), else the
full softmax's."""

from __future__ import annotations

from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing, sparse_layers, sparse_step
from mp_ckpt.families.qwen3 import qwen3_keys, qwen3_settings
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
             "intermediate_size": 6144}  # fmt: skip
RULES = (*model_rules(), *attention_rules(qkv_bias=None, qk_norm=True), *norm_rules(),
         *dense_mlp_rules(), *expert_rules(*_EXPERTS))  # fmt: skip


def _settings(config: dict) -> dict:
    config = dict(config)
    if "num_experts" in config:  # transformers' older key for num_local_experts
        config.setdefault("num_local_experts", config.pop("num_experts"))
    if config.get("norm_topk_prob", False) not in (True, False):
        raise ValueError(
            f"config.json norm_topk_prob={config['norm_topk_prob']!r}: expected true or false"
        )
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    base = qwen3_settings(config | {"intermediate_size": ffn})
    return base | routing(config, "num_local_experts", _DEFAULTS) | {
        "moe_ffn_hidden_size": positive(config, "moe_intermediate_size", _DEFAULTS),
        "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
        "moe_layer_freq": sparse_layers(config),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    step, dense = sparse_step(shapes["sparse"])
    config = moe_config(
        settings, shapes, tokens, dtype, "qwen3_moe", None, qk_layernorm=True
    ) | qwen3_keys(settings)
    del config["max_window_layers"]  # Qwen3-MoE has no such key
    return config | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "intermediate_size": shapes.get("ffn") or settings.get("ffn_hidden_size"),
        "moe_intermediate_size": shapes["expert_ffn"], "num_local_experts": shapes["experts"],
        "decoder_sparse_step": step, "mlp_only_layers": dense,
        "norm_topk_prob": not settings.get("moe_router_pre_softmax", False),
    }  # fmt: skip


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*_EXPERTS))  # fmt: skip
