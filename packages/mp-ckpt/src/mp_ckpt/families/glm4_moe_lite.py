"""GLM-4.7-Flash (model_type "glm4_moe_lite", Glm4MoeLiteForCausalLM): DeepSeek-V3's layers,
routing and names (deepseek_v3.py: multi-latent attention rotating interleaved pairs,
sigmoid routing by score + the correction bias beside a shared expert), with the dense
and expert layers listed per layer (mlp_layer_types, "dense" or "sparse"; absent: the
first layer dense, as transformers completes it) instead of first_k_dense_replace, and no
multi-token prediction layers.

Refused besides deepseek_v3.py's: mlp_layer_types with an expert layer before a dense
one (mp exports DeepSeek's layout of dense layers first), and multi-token prediction.
Its settings are DeepSeek-V3's: a checkpoint without a recorded family exports as
deepseek_v3, which transformers computes alike.
"""

from __future__ import annotations

from mp_ckpt.families import deepseek_v3
from mp_ckpt.families.deepseek import EXPERTS
from mp_ckpt.families.hf_settings import refuse
from mp_ckpt.families.moe import unfuse_experts
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_ARCH = "GLM-4.7-Flash"
_DEFAULTS = deepseek_v3.DEFAULTS | {
    "max_position_embeddings": 202752, "intermediate_size": 10240,
    "moe_intermediate_size": 1536, "q_lora_rank": 768, "qk_nope_head_dim": 192,
    "v_head_dim": 256, "n_routed_experts": 64, "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
}  # fmt: skip
"""transformers' Glm4MoeLiteConfig defaults, for a key config.json omits."""
_DROPPED = ("first_k_dense_replace", "num_nextn_predict_layers", "scoring_func",
            "topk_method", "qk_head_dim", "head_dim")  # fmt: skip
"""DeepSeek-V3's config.json keys Glm4MoeLiteConfig does not have."""


def _dense_first(config: dict) -> int:
    """The dense layers before the expert layers of mlp_layer_types."""
    layers = config["num_hidden_layers"]
    types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    dense = types.index("sparse") if "sparse" in types else layers
    if list(types) != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise ValueError(
            f"config.json mlp_layer_types={types!r}: expected {layers} entries, the dense "
            "layers first, then the sparse ones (DeepSeek's layout, which mp converts)"
        )
    return dense


def _settings(config: dict) -> dict:
    refuse(config, "rope_interleave", True)
    refuse(config, "num_nextn_predict_layers", 0)
    plain = {k: v for k, v in config.items() if k != "mlp_layer_types"}
    plain["first_k_dense_replace"] = _dense_first(config)
    return deepseek_v3.v3_settings(plain, _DEFAULTS, _ARCH)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if settings.get("mtp_num_layers"):
        raise ValueError(
            f"model_config mtp_num_layers={settings['mtp_num_layers']}: GLM-4.7-Flash has no "
            "multi-token prediction layers (export it as deepseek_v3)"
        )
    config = deepseek_v3.v3_config(settings, shapes, tokens, dtype, "glm4_moe_lite", _ARCH)
    dense = config["first_k_dense_replace"]
    for key in _DROPPED:
        config.pop(key, None)
    return config | {
        "architectures": ["Glm4MoeLiteForCausalLM"], "rope_interleave": True,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (shapes["layers"] - dense),
    }  # fmt: skip


FAMILY = Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", deepseek_v3.RULES, _settings,
                _config, prepare=unfuse_experts(*EXPERTS))  # fmt: skip
