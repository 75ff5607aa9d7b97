"""Megatron's command-line blend: ["0.3", "web", "0.7", "code"] or ["web", "code"].

A flat list alternates weights and dataset prefixes, or lists prefixes only
(then weights come from the datasets' sizes). An odd-length list holds
prefixes only. `get_blend_from_list` turns it into the (prefixes, weights)
pair that GPTDatasetConfig.blend takes.
"""

from __future__ import annotations

__all__ = ["get_blend_from_list"]


def get_blend_from_list(
    blend: list[str] | None,
) -> tuple[list[str], list[float] | None] | None:
    """["0.3", "web", "0.7", "code"] -> (["web", "code"], [0.3, 0.7]); no weights: None."""
    if blend is None:
        return None
    if not blend:
        raise ValueError("the blend list is empty: give dataset prefixes, optionally with weights")
    if len(blend) % 2:
        return [p.strip() for p in blend], None
    weights = [_number(w) for w in blend[0::2]]
    if all(w is None for w in weights):
        return [p.strip() for p in blend], None
    if any(w is None for w in weights):
        odd = [blend[2 * i] for i, w in enumerate(weights) if w is None]
        raise ValueError(
            f"blend {blend}: entries {odd} stand where weights should; give a weight before "
            "every prefix, or no weights at all"
        )
    negative = [w for w in weights if w < 0]
    if negative:
        raise ValueError(f"blend {blend}: weights must be >= 0, got {negative}")
    return [p.strip() for p in blend[1::2]], weights


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
