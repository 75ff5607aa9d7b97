"""DeepSeek-V3 (model_type "deepseek_v3", DeepseekV3ForCausalLM; DeepSeek-R1 and Kimi K2
share its layout): deepseek.py's layers with DeepSeek-V3's routing.

The router (transformers' DeepseekV3TopkRouter, DeepSeek's "noaux_tc"): sigmoid scores;
the experts chosen by score + e_score_correction_bias (mp's router.expert_bias:
moe_router_enable_expert_bias), within the topk_group best of n_group groups of
consecutive experts, each group ranked by the sum of its two best biased scores; the
chosen experts weighted by their unbiased scores normalized to sum 1 (norm_topk_prob),
times routed_scaling_factor. mp's group-limited router ranks a group by the sum of its
top moe_router_topk // moe_router_group_topk scores, so a config.json whose
num_experts_per_tok // topk_group is not 2 is refused where the groups limit the choice
(DeepSeek-V3's 8 // 4 is 2; Kimi K2 has one group). mp normalizes sigmoid weights when
it takes more than one expert: norm_topk_prob must be true then, false for one expert.

Refused besides deepseek.py's: scoring_func other than "sigmoid", topk_method other than
"noaux_tc", rope_interleave false (positional channels in halves instead of DeepSeek's
pairs), and weights of multi-token prediction layers (model.layers.{num_hidden_layers + k}.*:
mp's model has no place for them). The export writes num_nextn_predict_layers 0, and
DeepSeek's scoring_func and topk_method beside transformers' keys.
"""

from __future__ import annotations

import re

from mp_ckpt.families import deepseek
from mp_ckpt.families.deepseek import EXPERTS, deepseek_config, deepseek_settings, groups_kept
from mp_ckpt.families.hf_settings import check_computes, refuse
from mp_ckpt.families.moe import unfuse_experts
from mp_ckpt.families.moe_settings import positive
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY"]

_DEFAULTS = {
    "max_position_embeddings": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
}  # fmt: skip
"""transformers' DeepseekV3Config defaults, for a key config.json omits."""
_GROUP_RANK = 2  # the best scores a group is ranked by (transformers' topk(2))

RULES = (
    *deepseek.RULES,
    Rule(("mlp.router.expert_bias",), "model.layers.{i}.mlp.gate.e_score_correction_bias",
         "moe", keep_dtype=True),
)  # fmt: skip


def _settings(config: dict) -> dict:
    refuse(config, "scoring_func", "sigmoid")
    refuse(config, "topk_method", "noaux_tc")
    refuse(config, "rope_interleave", True)
    base = deepseek_settings(config, _DEFAULTS)
    topk = base["moe_router_topk"]
    norm = config.get("norm_topk_prob")
    norm = True if norm is None else norm
    if norm is not (topk > 1):
        raise ValueError(
            f"config.json norm_topk_prob={norm!r} with num_experts_per_tok={topk}: mp's sigmoid "
            "router normalizes the weights of more than one expert and leaves one expert's "
            f"alone (norm_topk_prob={topk > 1})"
        )
    groups, kept = positive(config, "n_group", _DEFAULTS), positive(config, "topk_group", _DEFAULTS)
    if base["num_moe_experts"] % groups:
        raise ValueError(f"config.json n_group={groups} does not divide n_routed_experts="
                         f"{base['num_moe_experts']}")  # fmt: skip
    routing = {"moe_router_num_groups": None, "moe_router_group_topk": None}
    if kept < groups:
        if topk // kept != _GROUP_RANK:
            raise ValueError(
                f"config.json num_experts_per_tok={topk} with topk_group={kept}: DeepSeek-V3 "
                f"ranks a group by its {_GROUP_RANK} best scores, mp's router by its "
                f"num_experts_per_tok // topk_group = {topk // kept} best (Megatron's rule)"
            )
        routing = {"moe_router_num_groups": groups, "moe_router_group_topk": kept}
    return base | routing | {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False,
    }  # fmt: skip


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_unfuse = unfuse_experts(*EXPERTS)


def _prepare(state: dict, config: dict) -> dict:
    """Refuses multi-token prediction layers by name; unfuses in-memory experts."""
    layers = config["num_hidden_layers"]
    found = {int(m.group(1)) for name in state if (m := _LAYER.match(name))}
    extra = sorted(found - set(range(layers)))
    if extra:
        raise ValueError(
            f"the Hugging Face weights hold model.layers.{extra[0]}.* beyond num_hidden_layers="
            f"{layers}: multi-token prediction layers (num_nextn_predict_layers="
            f"{config.get('num_nextn_predict_layers')}), which mp's model has no place for yet"
        )
    return _unfuse(state, config)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    topk = settings["moe_router_topk"]
    check_computes(settings, "deepseek_v3", {"moe_router_score_function": "sigmoid",
                                             "moe_router_enable_expert_bias": True})  # fmt: skip
    limit = groups_kept(settings)
    if limit is not None and topk // limit[1] != _GROUP_RANK:
        raise ValueError(
            f"model_config moe_router_topk={topk} with moe_router_group_topk={limit[1]}: "
            f"DeepSeek-V3 ranks a group by its {_GROUP_RANK} best scores"
        )
    groups, kept = (settings.get("moe_router_num_groups") or 1,
                    settings.get("moe_router_group_topk") or 1)  # fmt: skip
    return deepseek_config(settings, shapes, tokens, dtype, "deepseek_v3") | {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "n_group": groups, "topk_group": kept, "norm_topk_prob": topk > 1,
        "rope_interleave": True, "num_nextn_predict_layers": 0,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }  # fmt: skip


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", RULES, _settings, _config,
                prepare=_prepare)  # fmt: skip
