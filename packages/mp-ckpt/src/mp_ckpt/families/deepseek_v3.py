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
from mp_ckpt.families.deepseek import EXPERTS, deepseek_config, deepseek_settings
from mp_ckpt.families.hf_settings import check_computes, refuse
from mp_ckpt.families.moe import unfuse_experts
from mp_ckpt.families.moe_settings import check_group_rank, sigmoid_routing
from mp_ckpt.families.table import Family, Rule

__all__ = [
    "DEFAULTS",
    "EXPERT_BIAS",
    "FAMILY",
    "MTP_RULES",
    "RULES",
    "held_mtp_layers",
    "v3_config",
    "v3_settings",
]

DEFAULTS = {
    "max_position_embeddings": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
}  # fmt: skip
"""transformers' DeepseekV3Config defaults, for a key config.json omits."""

_MTP = "model.layers.{i}."
EXPERT_BIAS = Rule(
    ("mlp.router.expert_bias",),
    "model.layers.{i}.mlp.gate.e_score_correction_bias",
    "moe",
    keep_dtype=True,
)
"""The router's correction bias (transformers' e_score_correction_bias)."""
MTP_RULES = (
    Rule(("enorm.weight",), _MTP + "enorm.weight", "mtp"),
    Rule(("hnorm.weight",), _MTP + "hnorm.weight", "mtp"),
    Rule(("eh_proj.weight",), _MTP + "eh_proj.weight", "mtp"),
    Rule(("final_layernorm.weight",), _MTP + "shared_head.norm.weight", "mtp"),
    Rule(("embedding.word_embeddings.weight",), _MTP + "embed_tokens.weight", "mtp",
         model_copy=True),
    Rule(("output_layer.weight",), _MTP + "shared_head.head.weight", "mtp", model_copy=True),
)  # fmt: skip
"""The multi-token prediction modules' own tensors (GLM-4.5's too: glm4_moe.py)."""
RULES = (*deepseek.RULES, EXPERT_BIAS, *MTP_RULES)


def _settings(config: dict) -> dict:
    refuse(config, "rope_interleave", True)
    return v3_settings(config, DEFAULTS, "DeepSeek-V3")


def v3_settings(config: dict, defaults: dict, arch: str) -> dict:
    """The settings of a config.json of DeepSeek-V3's layers, routing and multi-token
    prediction (DeepSeek-V3.2's too: deepseek_v32.py); `defaults` are the family's for the
    keys config.json may omit, `arch` its name in errors."""
    refuse(config, "scoring_func", "sigmoid")
    refuse(config, "topk_method", "noaux_tc")
    base = deepseek_settings(config, defaults)
    routing = sigmoid_routing(config, base["num_moe_experts"], base["moe_router_topk"],
                              defaults, arch)  # fmt: skip
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


def held_mtp_layers(config: dict, names) -> dict:
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
    # (DeepSeek's sparse attention, "dsa", is DeepSeek-V3.2's: deepseek_v32.py)
    check_computes(settings, "deepseek_v3", {"experimental_attention_variant": None})
    return v3_config(settings, shapes, tokens, dtype, "deepseek_v3", "DeepSeek-V3") | {
        "architectures": ["DeepseekV3ForCausalLM"], "rope_interleave": True,
    }  # fmt: skip


def v3_config(settings: dict, shapes: dict, tokens: dict, dtype: str, model_type: str,
              arch: str) -> dict:  # fmt: skip
    """The config.json of DeepSeek-V3's layers, routing and multi-token prediction under
    `model_type` (`arch`: its name in errors)."""
    check_computes(settings, model_type, {"moe_router_score_function": "sigmoid",
                                          "moe_router_enable_expert_bias": True})  # fmt: skip
    groups, kept = check_group_rank(settings, arch)
    mtp = settings.get("mtp_num_layers") or 0
    if mtp and shapes["tied"]:
        raise ValueError(
            f"model_config mtp_num_layers={mtp} with a tied output layer: DeepSeek's "
            "multi-token prediction layers hold a copy of a separate one"
        )
    return deepseek_config(settings, shapes, tokens, dtype, model_type) | {
        "model_type": model_type, "n_group": groups, "topk_group": kept,
        "norm_topk_prob": settings["moe_router_topk"] > 1, "num_nextn_predict_layers": mtp,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }  # fmt: skip


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS), held=held_mtp_layers)  # fmt: skip
