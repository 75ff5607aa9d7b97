"""Ministral 3 (model_type "ministral3", Ministral3ForCausalLM: Ministral 3 3B, 8B, 14B, the
text model of Mistral's 2025 small models): Llama's layers and tensors with YaRN-scaled
rotary embeddings (rope_type "yarn", or plain RoPE) and every layer's rotated queries
scaled by their position, 1 + beta ln(1 + floor(p / L)) with rope_parameters'
llama_4_scaling_beta (beta) and original_max_position_embeddings (L): mp's
query_log_scale_beta and query_log_scale_length (config_query_scale.py in mp-layers).

rope_parameters is written back with transformers' keys: llama_4_scaling_beta and
original_max_position_embeddings, with YaRN its keys (yarn.py), "type" beside "rope_type"
and max_position_embeddings (the model's), as transformers' default Ministral 3 writes.
Refused besides Llama's: a sliding_window, rope types other than default and yarn, a
missing or non-positive llama_4_scaling_beta (transformers' attention always scales), an
explicit YaRN attention_factor (yarn.py: mp derives it).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family
from mp_ckpt.families.yarn import yarn_parameters, yarn_settings

__all__ = ["FAMILY"]

RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules())


def _query_scale(rope: dict) -> dict:
    beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
        raise ValueError(f"config.json rope_parameters llama_4_scaling_beta={beta!r}: "
                         "Ministral 3's attention scales its queries by it (a number "
                         "> 0)")  # fmt: skip
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"config.json rope_parameters original_max_position_embeddings="
                         f"{length!r}: the length of the queries' scaling steps")  # fmt: skip
    return {"query_log_scale_beta": float(beta), "query_log_scale_length": length}


def _settings(config: dict) -> dict:
    if config.get("sliding_window") is not None:
        raise ValueError(f"config.json sliding_window={config['sliding_window']!r}: mp's "
                         "Ministral 3 attends to every earlier position")  # fmt: skip
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"config.json rope_type={kind!r}: mp's Ministral 3 rotates with "
                         "'default' or 'yarn'")  # fmt: skip
    theta = rope.get("rope_theta", config.get("rope_theta", 1000000.0))
    plain = {k: v for k, v in config.items() if k != "rope_scaling"}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    base = llama_settings(plain, rms_norm_eps=1e-5, max_positions=262144)
    if kind == "yarn":
        base |= yarn_settings(rope, base["max_position_embeddings"])
    return base | _query_scale(rope)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    beta, length = settings.get("query_log_scale_beta"), settings.get("query_log_scale_length")
    if beta is None:
        raise ValueError("model_config query_log_scale_beta=None: Ministral 3's attention "
                         "scales its queries by their position (llama_4_scaling_beta)")  # fmt: skip
    position = settings.get("position_embedding_type", "rope")
    config = base_config(settings, shapes, tokens, dtype, "ministral3",
                         position_embedding_type=position, query_log_scale_beta=beta)  # fmt: skip
    rope = config["rope_parameters"]
    if position == "yarn":
        positions = config["max_position_embeddings"]
        rope = yarn_parameters(settings) | {"type": "yarn", "max_position_embeddings": positions}
        if rope["original_max_position_embeddings"] != length:
            raise ValueError(
                f"model_config query_log_scale_length={length} with "
                f"yarn_original_max_position_embeddings={rope['original_max_position_embeddings']}"
                ": Ministral 3's config.json gives both as original_max_position_embeddings"
            )
    rope = rope | {"original_max_position_embeddings": length, "llama_4_scaling_beta": beta}
    return config | {
        "architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3",
        "rope_parameters": rope, "sliding_window": None,
    }  # fmt: skip


FAMILY = Family("ministral3", "Ministral3ForCausalLM", RULES, _settings, _config)
