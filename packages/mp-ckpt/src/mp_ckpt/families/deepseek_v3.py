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

Multi-token prediction: DeepSeek-V3's checkpoints hold module k (num_nextn_predict_layers
of them) as layer num_hidden_layers + k, mp's mtp.layers.{k} (mtp_num_layers):

    model.layers.{L + k}.enorm.weight, hnorm.weight     enorm.weight, hnorm.weight
    eh_proj.weight [h, 2h] (of cat(enorm(e), hnorm(h)))  eh_proj.weight
    shared_head.norm.weight                             final_layernorm.weight
    self_attn.*, mlp.*, input_layernorm.weight,         transformer_layer.* (as decoder
        post_attention_layernorm.weight                     layer L - 1's)
    embed_tokens.weight, shared_head.head.weight        (copies of the embedding and the
                                                        output layer: checked, not kept)

transformers builds no such layer and leaves them out when it saves while config.json
keeps counting them (1 by default): the import counts the layers the weights hold.

Refused besides deepseek.py's: scoring_func other than "sigmoid", topk_method other than
"noaux_tc", rope_interleave false (positional channels in halves instead of DeepSeek's
pairs), multi-token prediction with a tied output layer, and weights of more layers than
num_hidden_layers + num_nextn_predict_layers. The export writes DeepSeek's scoring_func
and topk_method beside transformers' keys.
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

_MTP = "model.layers.{i}."
RULES = (
    *deepseek.RULES,
    Rule(("mlp.router.expert_bias",), "model.layers.{i}.mlp.gate.e_score_correction_bias",
         "moe", keep_dtype=True),
    Rule(("enorm.weight",), _MTP + "enorm.weight", "mtp"),
    Rule(("hnorm.weight",), _MTP + "hnorm.weight", "mtp"),
    Rule(("eh_proj.weight",), _MTP + "eh_proj.weight", "mtp"),
    Rule(("final_layernorm.weight",), _MTP + "shared_head.norm.weight", "mtp"),
    Rule(("embedding.word_embeddings.weight",), _MTP + "embed_tokens.weight", "mtp",
         model_copy=True),
    Rule(("output_layer.weight",), _MTP + "shared_head.head.weight", "mtp", model_copy=True),
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
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp and not base["untie_embeddings_and_output_weights"]:
        raise ValueError(
            f"config.json num_nextn_predict_layers={mtp} with tie_word_embeddings=True: mp "
            "converts DeepSeek's multi-token prediction with a separate output layer"
        )
    return base | routing | {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False, "mtp_num_layers": mtp or None,
    }  # fmt: skip


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _held(config: dict, names) -> dict:
    """num_nextn_predict_layers as the weights hold them (module docstring): the layers
    past num_hidden_layers, which must follow one another, and no more than config.json
    counts."""
    layers = config["num_hidden_layers"]
    extra = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))} - set(range(layers)))
    counted = config.get("num_nextn_predict_layers") or 0
    if extra != list(range(layers, layers + len(extra))) or len(extra) > counted:
        raise ValueError(
            f"the Hugging Face weights hold layers {extra} past num_hidden_layers={layers}, "
            f"where config.json counts num_nextn_predict_layers={counted} multi-token "
            "prediction layers after them"
        )
    return config | {"num_nextn_predict_layers": len(extra)} if counted else config


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
    mtp = settings.get("mtp_num_layers") or 0
    if mtp and shapes["tied"]:
        raise ValueError(
            f"model_config mtp_num_layers={mtp} with a tied output layer: DeepSeek's "
            "multi-token prediction layers hold a copy of a separate one"
        )
    return deepseek_config(settings, shapes, tokens, dtype, "deepseek_v3") | {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "n_group": groups, "topk_group": kept, "norm_topk_prob": topk > 1,
        "rope_interleave": True, "num_nextn_predict_layers": mtp,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }  # fmt: skip


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS), held=_held)  # fmt: skip
