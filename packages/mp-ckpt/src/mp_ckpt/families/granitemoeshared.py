"""Granite MoE with a shared MLP (model_type "granitemoeshared",
GraniteMoeSharedForCausalLM): granitemoe.py's layers with shared_mlp, a gated MLP of
shared_intermediate_size S beside the experts in every layer (mp's shared expert,
ungated), its gate and up projections one tensor; S 0 is a model without it (as
granitemoe's).
"""

from __future__ import annotations

from mp_ckpt.families import granitemoe
from mp_ckpt.families.table import Family

__all__ = ["FAMILY", "shared_width"]


def _shared(settings: dict) -> bool:
    return bool(settings.get("moe_shared_expert_intermediate_size"))


RULES = (*granitemoe.RULES,
         *granitemoe.shared_mlp_rules("mlp.shared_experts", "moe", when=_shared))  # fmt: skip


def shared_width(config: dict, default: int) -> int:
    """shared_intermediate_size (0: no shared MLP)."""
    width = config.get("shared_intermediate_size", default)
    if not isinstance(width, int) or isinstance(width, bool) or width < 0:
        raise ValueError(f"config.json shared_intermediate_size={width!r}: expected 0 (no "
                         "shared MLP) or a positive integer")  # fmt: skip
    return width


def _settings(config: dict) -> dict:
    width = shared_width(config, 0)  # GraniteMoeSharedConfig's default
    shared = {"moe_shared_expert_intermediate_size": width or None}
    return granitemoe.FAMILY.settings(config) | shared


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    return granitemoe.granite_moe_config(settings, shapes, tokens, dtype, "granitemoeshared") | {
        "architectures": ["GraniteMoeSharedForCausalLM"], "model_type": "granitemoeshared",
        "shared_intermediate_size": shapes.get("shared_ffn") or 0,
    }  # fmt: skip


FAMILY = Family("granitemoeshared", "GraniteMoeSharedForCausalLM", RULES, _settings, _config,
                prepare=granitemoe.in_memory_names)  # fmt: skip
