"""YaRN rotary scaling: config.json's rope_parameters (rope_type "yarn") <-> Megatron's
position_embedding_type "yarn" with the yarn_* fields.

    factor                              yarn_rotary_scaling_factor
    original_max_position_embeddings    yarn_original_max_position_embeddings
    beta_fast, beta_slow                yarn_beta_fast, yarn_beta_slow (32 and 1 when absent)
    mscale, mscale_all_dim              yarn_mscale, yarn_mscale_all_dim: transformers uses
                                        them only when both are set; else the attention
                                        factor is 0.1 ln(factor) + 1, mp's with 1 and 0
    truncate (true when absent)         yarn_correction_range_round_to_int

An explicit attention_factor is refused: mp derives it from the mscales.
"""

from __future__ import annotations

import math

__all__ = ["yarn_attention_factor", "yarn_parameters", "yarn_settings"]


def yarn_settings(parameters: dict, max_positions: int) -> dict:
    """The settings of a rope_parameters dict whose rope_type is "yarn"."""
    if parameters.get("attention_factor") is not None:
        raise ValueError(
            f"config.json rope_parameters attention_factor={parameters['attention_factor']!r}: "
            "mp derives YaRN's attention factor from factor, mscale and mscale_all_dim"
        )
    original = parameters.get("original_max_position_embeddings")
    factor = parameters.get("factor")
    if original is None:
        raise ValueError("config.json rope_type='yarn' without original_max_position_embeddings")
    if factor is None:
        factor = max_positions / original
    both = bool(parameters.get("mscale")) and bool(parameters.get("mscale_all_dim"))
    return {
        "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": int(original),
        "yarn_beta_fast": float(parameters.get("beta_fast") or 32),
        "yarn_beta_slow": float(parameters.get("beta_slow") or 1),
        "yarn_mscale": float(parameters["mscale"]) if both else 1.0,
        "yarn_mscale_all_dim": float(parameters["mscale_all_dim"]) if both else 0.0,
        "yarn_correction_range_round_to_int": bool(parameters.get("truncate", True)),
    }  # fmt: skip


def yarn_parameters(settings: dict) -> dict:
    """config.json's rope_parameters of YaRN settings (transformers 5's form)."""
    parameters = {
        "rope_theta": float(settings.get("rotary_base", 10000)), "rope_type": "yarn",
        "factor": settings.get("yarn_rotary_scaling_factor", 1.0),
        "original_max_position_embeddings": settings.get(
            "yarn_original_max_position_embeddings", 4096),
        "beta_fast": settings.get("yarn_beta_fast", 32.0),
        "beta_slow": settings.get("yarn_beta_slow", 1.0),
    }  # fmt: skip
    if not settings.get("yarn_correction_range_round_to_int", True):
        parameters["truncate"] = False  # transformers' default (absent) is true
    mscale, all_dim = settings.get("yarn_mscale", 1.0), settings.get("yarn_mscale_all_dim", 0.0)
    if (mscale, all_dim) != (1.0, 0.0):
        if not (mscale and all_dim):
            raise ValueError(
                f"model_config yarn_mscale={mscale!r}, yarn_mscale_all_dim={all_dim!r}: "
                "transformers reads the mscales only when both are non-zero"
            )
        parameters |= {"mscale": mscale, "mscale_all_dim": all_dim}
    return parameters


def yarn_attention_factor(settings: dict) -> float:
    """The attention factor mp derives from YaRN settings (rope.py's, transformers' where
    attention_factor is absent): (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1), 1
    for s <= 1; 0.1 ln s + 1 with the mscales' defaults."""

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    factor = settings.get("yarn_rotary_scaling_factor", 1.0)
    return mscale(settings.get("yarn_mscale", 1.0)) / mscale(
        settings.get("yarn_mscale_all_dim", 0.0)
    )
