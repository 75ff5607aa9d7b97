"""GLM-4.5, GLM-4.6 and GLM-4.7 (model_type "glm4_moe", Glm4MoeForCausalLM): Llama's
grouped-query attention with q, k and v biases (attention_bias) and, with use_qk_norm, a
per-head RMSNorm of queries and keys; rotary embeddings on the first
partial_rotary_factor of each head's channels, in halves (rotary_percent); a dense SwiGLU
MLP in the first first_k_dense_replace layers, routed experts beside shared experts in
the others, routed as DeepSeek-V3 routes (deepseek_v3.py: sigmoid scores, the correction
bias, group limits, norm_topk_prob, routed_scaling_factor); multi-token prediction
modules after the decoder's layers, laid out as DeepSeek-V3's.

Hugging Face (model.layers.{i}.)         mp (decoder.layers.{i}.)
    self_attn.{q,k,v}_proj.{weight,bias} self_attention.linear_qkv.{q,k,v}.* (llama_style.py)
    self_attn.{q,k}_norm.weight          self_attention.{q,k}_layernorm.weight
    self_attn.o_proj.weight              self_attention.linear_proj.weight
    mlp.{gate,up,down}_proj.weight       mlp.linear_fc1.{gate,up}.weight, mlp.linear_fc2.weight
    mlp.gate.weight, mlp.experts.*       mlp.router.weight, mlp.experts.* (moe.py)
    mlp.gate.e_score_correction_bias     mlp.router.expert_bias
    mlp.shared_experts.*                 mlp.shared_experts.* (moe.py, ungated)
and Llama's norms and embeddings; model.layers.{L + k}. the k-th multi-token prediction
module, mtp.layers.{k}. (deepseek_v3.py's table).

config.json -> settings, beside Llama's (hf_settings.py):

    attention_bias, use_qk_norm          add_qkv_bias, qk_layernorm
    partial_rotary_factor (in rope_parameters or at the top; 0.5 when absent)
                                         rotary_percent
    first_k_dense_replace k              moe_layer_freq [0] * k + [1] * (num_layers - k)
    n_routed_experts, num_experts_per_tok, moe_intermediate_size    num_moe_experts,
                                         moe_router_topk, moe_ffn_hidden_size
    n_shared_experts n                   moe_shared_expert_intermediate_size n x
                                         moe_ffn_hidden_size
    routed_scaling_factor, n_group, topk_group, norm_topk_prob    as DeepSeek-V3's
    num_nextn_predict_layers             mtp_num_layers, as the weights hold them

Defaults are Glm4MoeConfig's (rms_norm_eps 1e-5, 128 experts, routed_scaling_factor 1, one
group, ...). The router computes in fp32, as transformers' does. Refused besides Llama's:
the routing deepseek_v3.py refuses, no expert layer, and multi-token prediction with a
tied output layer.
"""

from __future__ import annotations

from mp_ckpt.families.deepseek import EXPERTS, dense_first_shared, expert_settings
from mp_ckpt.families.deepseek_v3 import EXPERT_BIAS, MTP_RULES, held_mtp_layers
from mp_ckpt.families.hf_settings import base_config, check_computes, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, shared_expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import check_group_rank, positive, sigmoid_routing
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_ARCH = "GLM-4.5"
_DEFAULTS = {
    "max_position_embeddings": 131072, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "partial_rotary_factor": 0.5,
}  # fmt: skip
"""transformers' Glm4MoeConfig defaults, for a key config.json omits."""
RULES = (
    *model_rules(),
    *attention_rules(qkv_bias=None, qk_norm=None),
    *norm_rules(),
    *dense_mlp_rules(),
    *expert_rules(*EXPERTS),
    *shared_expert_rules("shared_experts", gated=False),
    EXPERT_BIAS,
    *MTP_RULES,
)


def _settings(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or {})
    partial = rope.pop(
        "partial_rotary_factor",
        config.get("partial_rotary_factor", _DEFAULTS["partial_rotary_factor"]),
    )
    plain = {k: v for k, v in config.items() if k != "attention_bias"}
    plain |= {"rope_parameters": rope,
              "intermediate_size": positive(config, "intermediate_size", _DEFAULTS)}  # fmt: skip
    base = llama_settings(plain, rms_norm_eps=1e-5,
                          max_positions=_DEFAULTS["max_position_embeddings"])  # fmt: skip
    experts = expert_settings(config, _DEFAULTS, base["num_layers"], _ARCH)
    routing = sigmoid_routing(config, experts["num_moe_experts"], experts["moe_router_topk"],
                              _DEFAULTS, _ARCH)  # fmt: skip
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp and config.get("tie_word_embeddings", False):
        raise ValueError(
            f"config.json num_nextn_predict_layers={mtp} with tie_word_embeddings=True: mp "
            "converts the multi-token prediction modules with a separate output layer"
        )
    return base | experts | routing | {
        "add_qkv_bias": bool(config.get("attention_bias", False)),
        "qk_layernorm": bool(config.get("use_qk_norm", False)), "rotary_percent": float(partial),
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False, "mtp_num_layers": mtp or None,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    check_computes(settings, "glm4_moe", {"moe_router_score_function": "sigmoid",
                                          "moe_router_enable_expert_bias": True,
                                          "moe_expert_capacity_factor": None,
                                          "moe_shared_expert_gate": False})  # fmt: skip
    groups, kept = check_group_rank(settings, _ARCH)
    dense, shared = dense_first_shared(shapes, "glm4_moe")
    mtp = settings.get("mtp_num_layers") or 0
    if mtp and shapes["tied"]:
        raise ValueError(
            f"model_config mtp_num_layers={mtp} with a tied output layer: GLM-4.5's "
            "multi-token prediction modules hold a copy of a separate one"
        )
    partial = settings.get("rotary_percent", 1.0)
    qk_norm = bool(settings.get("qk_layernorm", False))
    ffn = shapes.get("ffn") or settings.get("ffn_hidden_size")
    config = base_config(settings, shapes | {"ffn": ffn}, tokens, dtype, "glm4_moe",
                         rotary_percent=partial, qk_layernorm=qk_norm)  # fmt: skip
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": partial}
    return config | {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "attention_bias": bool(settings.get("add_qkv_bias")), "use_qk_norm": qk_norm,
        "n_routed_experts": shapes["experts"], "num_experts_per_tok": settings["moe_router_topk"],
        "moe_intermediate_size": shapes["expert_ffn"], "n_shared_experts": shared,
        "first_k_dense_replace": dense,
        "routed_scaling_factor": float(settings.get("moe_router_topk_scaling_factor") or 1.0),
        "n_group": groups, "topk_group": kept, "norm_topk_prob": settings["moe_router_topk"] > 1,
        "num_nextn_predict_layers": mtp, "use_cache": True, "output_router_logits": False,
    }  # fmt: skip


FAMILY = Family("glm4_moe", "Glm4MoeForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS), held=held_mtp_layers)  # fmt: skip
