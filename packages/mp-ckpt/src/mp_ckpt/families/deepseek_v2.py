"""DeepSeek-V2 and DeepSeek-V2-Lite (model_type "deepseek_v2", DeepseekV2ForCausalLM):
deepseek.py's layers with DeepSeek-V2's routing.

The router (transformers' DeepseekV2TopkRouter): a softmax over every expert's logit, the
top k of those probabilities as the weights, not renormalized (moe_router_pre_softmax
true), times routed_scaling_factor. topk_method "greedy" takes the top k of all experts
(V2-Lite); "group_limited_greedy" first keeps the topk_group of n_group groups of
consecutive experts with the highest best probability. mp's group-limited router ranks a
group by the sum of its top moe_router_topk // moe_router_group_topk probabilities
(Megatron's rule), the best one only where that is 1: a config.json where it is not
(DeepSeek-V2's 6 // 3 is 2) is refused, as is norm_topk_prob true (transformers'
DeepseekV2 ignores it where DeepSeek's own code renormalizes the top k: they disagree).

Refused besides deepseek.py's: scoring_func other than "softmax", another topk_method.
The export writes DeepSeek's scoring_func beside transformers' keys.
"""

from __future__ import annotations

from mp_ckpt.families.deepseek import (
    EXPERTS,
    RULES,
    deepseek_config,
    deepseek_settings,
    groups_kept,
)
from mp_ckpt.families.hf_settings import check_computes, refuse
from mp_ckpt.families.moe import unfuse_experts
from mp_ckpt.families.moe_settings import positive
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_DEFAULTS = {
    "max_position_embeddings": 2048, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "first_k_dense_replace": 0, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "num_experts_per_tok": None, "n_shared_experts": 2,
    "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None,
}  # fmt: skip
"""transformers' DeepseekV2Config defaults, for a key config.json omits (none for
num_experts_per_tok, n_group and topk_group: they must be given)."""
_METHODS = ("greedy", "group_limited_greedy")


def _settings(config: dict) -> dict:
    refuse(config, "scoring_func", "softmax")
    method = config.get("topk_method") or "greedy"
    if method not in _METHODS:
        raise ValueError(
            f"config.json topk_method={method!r}: mp computes DeepSeek-V2's {_METHODS[0]!r} "
            f"and {_METHODS[1]!r}"
        )
    if config.get("norm_topk_prob"):
        raise ValueError(
            f"config.json norm_topk_prob={config['norm_topk_prob']!r}: transformers' "
            "DeepseekV2 ignores it and DeepSeek's own code renormalizes the top k; mp "
            "computes only norm_topk_prob=false (the released models')"
        )
    base = deepseek_settings(config, _DEFAULTS)
    routing = {"moe_router_num_groups": None, "moe_router_group_topk": None}
    if method == "group_limited_greedy":
        groups = positive(config, "n_group", _DEFAULTS)
        kept = positive(config, "topk_group", _DEFAULTS)
        topk = base["moe_router_topk"]
        if base["num_moe_experts"] % groups:
            raise ValueError(f"config.json n_group={groups} does not divide n_routed_experts="
                             f"{base['num_moe_experts']}")  # fmt: skip
        if kept < groups:
            if topk // kept != 1:
                raise ValueError(
                    f"config.json num_experts_per_tok={topk} with topk_group={kept}: "
                    "DeepSeek-V2 ranks a group by its best probability, mp's router by the "
                    f"sum of its num_experts_per_tok // topk_group = {topk // kept} best "
                    "(Megatron's rule)"
                )
            routing = {"moe_router_num_groups": groups, "moe_router_group_topk": kept}
    return base | routing | {
        "moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
        "moe_router_enable_expert_bias": False,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    topk = settings["moe_router_topk"]
    check_computes(settings, "deepseek_v2", {"experimental_attention_variant": None,
                                             "moe_router_score_function": "softmax",
                                             "moe_router_pre_softmax": True,
                                             "moe_router_enable_expert_bias": False})  # fmt: skip
    limit = groups_kept(settings)
    if limit is not None and topk // limit[1] != 1:
        raise ValueError(
            f"model_config moe_router_topk={topk} with moe_router_group_topk={limit[1]}: "
            "DeepSeek-V2 ranks a group by its best probability"
        )
    groups, kept = limit or (None, None)
    return deepseek_config(settings, shapes, tokens, dtype, "deepseek_v2") | {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "topk_method": "greedy" if limit is None else "group_limited_greedy",
        "n_group": groups, "topk_group": kept, "norm_topk_prob": False, "mlp_bias": False,
        "scoring_func": "softmax",
    }  # fmt: skip


FAMILY = Family("deepseek_v2", "DeepseekV2ForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS))  # fmt: skip
