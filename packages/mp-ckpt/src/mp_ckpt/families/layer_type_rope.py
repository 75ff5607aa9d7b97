"""Rotary parameters per layer type (OLMo 3's and Gemma 3's config.json): transformers 5
writes rope_parameters as {"sliding_attention": {...}, "full_attention": {...}}, earlier
versions one set (with rope_scaling applied to the full layers). The full layers' set is
the model's rotary embeddings; the sliding layers rotate with plain RoPE, of
window_rotary_base where their base differs from the full layers' or those are scaled.

    split_rope(config, full_theta, local_theta)   -> (full layers' set, sliding layers')
    window_base(types, full, local)               -> {"window_rotary_base": ...} or {}
    nested_rope(settings, full)                   -> config.json's rope_parameters
"""

from __future__ import annotations

__all__ = ["nested_rope", "split_rope", "window_base"]


def split_rope(config: dict, full_theta: float, local_theta: float) -> tuple[dict, dict]:
    """(the full layers' rotary parameters, the sliding layers'); the thetas: the family's
    defaults where config.json gives none."""
    given = config.get("rope_parameters") or {}
    if "full_attention" in given or "sliding_attention" in given:
        full = {"rope_type": "default", "rope_theta": full_theta} | (
            given.get("full_attention") or {}
        )
        local = {"rope_type": "default", "rope_theta": local_theta} | (
            given.get("sliding_attention") or {}
        )
    else:  # one set, scaled by rope_scaling on the full layers
        full = {"rope_type": "default", "rope_theta": config.get("rope_theta", full_theta)}
        full |= given | (config.get("rope_scaling") or {})
        local = {
            "rope_type": "default",
            "rope_theta": config.get("rope_local_base_freq", full["rope_theta"]),
        }
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json rope_parameters.sliding_attention rope_type={local['rope_type']!r}: "
            "mp rotates the sliding layers with plain RoPE"
        )
    return full, local


def window_base(types: list[str], full: dict, local: dict) -> dict:
    """window_rotary_base where the sliding layers rotate otherwise than the full ones."""
    theta = local["rope_theta"]
    scaled = full.get("rope_type", full.get("type", "default")) != "default"
    if "sliding_attention" not in types or (not scaled and theta == full["rope_theta"]):
        return {}
    if float(theta) != int(theta):
        raise ValueError(f"config.json sliding_attention rope_theta={theta!r}: mp's "
                         "window_rotary_base is an integer")  # fmt: skip
    return {"window_rotary_base": int(theta)}


def nested_rope(settings: dict, full: dict) -> dict:
    """rope_parameters per layer type: `full` for the full layers, plain RoPE of
    window_rotary_base (else the full layers' base) for the sliding ones."""
    local_theta = settings.get("window_rotary_base") or full["rope_theta"]
    return {"sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
            "full_attention": full}  # fmt: skip
