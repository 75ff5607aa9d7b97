"""Arcee (model_type "arcee", ArceeForCausalLM: AFM-4.5B): Llama's layers with an ungated
MLP of squared ReLU (hidden_act "relu2": mp's activation "squared_relu", Nemotron's), its
up_proj mp's linear_fc1; rotary embeddings plain or YaRN-scaled (rope_type "yarn",
position_embedding_type "yarn": the released model's 4k context extended to 64k).

Refused besides Llama's: another hidden_act, mlp_bias, attention_bias, an explicit YaRN
attention_factor (yarn.py: mp derives it).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family
from mp_ckpt.families.yarn import yarn_parameters, yarn_settings

__all__ = ["FAMILY"]

RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules(gated=False))


def _settings(config: dict) -> dict:
    refuse(config, "hidden_act", "relu2")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    plain = {k: v for k, v in config.items() if k not in ("hidden_act", "rope_scaling")}
    if kind == "yarn":
        plain["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    base = llama_settings(plain, rms_norm_eps=1e-5, max_positions=4096)
    base["activation"] = "squared_relu"
    if kind != "yarn":
        return base
    return base | yarn_settings(rope, base["max_position_embeddings"])


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    position = settings.get("position_embedding_type", "rope")
    config = base_config(settings, shapes, tokens, dtype, "arcee", activation="squared_relu",
                         position_embedding_type=position)  # fmt: skip
    if position == "yarn":
        config["rope_parameters"] = yarn_parameters(settings)
    return config | {
        "architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "relu2",
        "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


FAMILY = Family("arcee", "ArceeForCausalLM", RULES, _settings, _config)
