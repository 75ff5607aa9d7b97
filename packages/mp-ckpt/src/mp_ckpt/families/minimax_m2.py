"""MiniMax-M2 (model_type "minimax_m2", MiniMaxM2ForCausalLM): pre-norm layers whose queries
and keys are normalized over all heads (OLMo 2's norm: qk_layernorm_scope "all_heads"),
the first rotary_dim channels of each head rotated (rotary_percent), and every MLP a
mixture of experts without a shared one, routed as DeepSeek-V3 routes without groups: a
sigmoid score per expert, the top k chosen by score + correction bias
(e_score_correction_bias, mp's router expert_bias), their scores renormalized.

Hugging Face (model.layers.{i}.)                      mp (decoder.layers.{i}.)
    self_attn.*, input_layernorm, post_attention_...  as Llama's, q/k norms as OLMo 2's
    block_sparse_moe.gate.weight                      mlp.router.weight
    block_sparse_moe.e_score_correction_bias          mlp.router.expert_bias
    block_sparse_moe.experts.{e}.w1, w3, w2           mlp.experts.linear_fc1.gate, .up,
                                                      linear_fc2 (stacked)

The released config.json gives the rotation as rotary_dim (channels), transformers 5 also
as rope_parameters' partial_rotary_factor; both are read and both written. Refused:
use_qk_norm false or a qk_norm_type other than "per_layer", a scoring_func other than
sigmoid, use_routing_bias false, a shared expert (shared_intermediate_size),
router_jitter_noise, and multi-token prediction modules (num_mtp_modules: transformers'
model has none).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, check_computes, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import aux_loss_coef, positive, routing
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY"]

_BLOCK = "block_sparse_moe"
_EXPERTS = (_BLOCK, "w1", "w3", "w2")
_DEFAULTS = {"num_local_experts": 256, "num_experts_per_tok": 8, "intermediate_size": 1536}
_NORMS = {"qk_layernorm": True, "qk_layernorm_scope": "all_heads"}
_ROUTING = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": False, "moe_router_num_groups": None,
            "moe_router_topk_scaling_factor": None, "moe_expert_capacity_factor": None,
            "moe_shared_expert_intermediate_size": None}  # fmt: skip
EXPERT_BIAS = Rule(("mlp.router.expert_bias",),
                   f"model.layers.{{i}}.{_BLOCK}.e_score_correction_bias", "moe",
                   keep_dtype=True)  # fmt: skip
RULES = (*model_rules(), *attention_rules(qk_norm=True), *norm_rules(),
         *expert_rules(*_EXPERTS), EXPERT_BIAS)  # fmt: skip


def _partial(config: dict) -> float:
    """The rotated share of each head: rope_parameters' partial_rotary_factor or
    rotary_dim / head_dim (checked to agree where both are given)."""
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    given = config.get("rotary_dim")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if given is not None and partial is not None and given != partial * head:
        raise ValueError(
            f"config.json rotary_dim={given!r} with partial_rotary_factor={partial!r}: "
            f"head_dim={head} x factor should be rotary_dim"
        )
    return float(partial if partial is not None else (given or head) / head)


def _settings(config: dict) -> dict:
    refuse(config, "use_qk_norm", True)
    refuse(config, "qk_norm_type", "per_layer")
    refuse(config, "scoring_func", "sigmoid")
    refuse(config, "use_routing_bias", True)
    for key in ("shared_intermediate_size", "router_jitter_noise", "num_mtp_modules"):
        if config.get(key):
            raise ValueError(f"config.json {key}={config[key]!r}: mp's MiniMax-M2 computes "
                             f"only {key}=0 (transformers' model has none)")  # fmt: skip
    partial = _partial(config)
    rope = {k: v for k, v in (config.get("rope_parameters") or {}).items()
            if k != "partial_rotary_factor"}  # fmt: skip
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    plain = config | {"intermediate_size": ffn, "rope_parameters": rope}
    base = llama_settings(plain, rope_theta=5000000.0, max_positions=196608)
    return base | _NORMS | routing(config, "num_local_experts", _DEFAULTS) | _ROUTING | {
        "rotary_percent": partial, "moe_ffn_hidden_size": ffn, "moe_router_dtype": "fp32",
        "moe_shared_expert_gate": False, "moe_layer_freq": [1],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    check_computes(settings, "minimax_m2", _ROUTING)
    if not all(shapes["sparse"]):
        raise ValueError("model_config moe_layer_freq: every MiniMax-M2 layer has experts")
    topk = settings.get("moe_router_topk")
    partial = settings.get("rotary_percent", 1.0)
    config = base_config(settings, shapes | {"ffn": shapes["expert_ffn"]}, tokens, dtype,
                         "minimax_m2", rotary_percent=partial, **_NORMS)  # fmt: skip
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": partial}
    return config | {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "rotary_dim": round(partial * shapes["head_dim"]),
        "num_local_experts": shapes["experts"], "num_experts_per_tok": topk,
        "router_aux_loss_coef": aux_loss_coef(settings),
        "router_jitter_noise": 0.0, "use_cache": True, "output_router_logits": False,
    }  # fmt: skip


def _prepare(state: dict, config: dict) -> dict:
    """transformers' in-memory names (mlp.gate, mlp.e_score_correction_bias, fused
    experts) -> the saved ones."""
    bias = ".mlp.e_score_correction_bias"
    renamed = {name.replace(bias, f".{_BLOCK}.e_score_correction_bias"): tensor
               for name, tensor in state.items()}  # fmt: skip
    return unfuse_experts(*_EXPERTS)(renamed, config)


FAMILY = Family("minimax_m2", "MiniMaxM2ForCausalLM", RULES, _settings, _config,
                prepare=_prepare)  # fmt: skip
