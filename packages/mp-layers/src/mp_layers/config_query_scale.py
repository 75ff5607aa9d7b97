"""TransformerConfig's scaling of the queries by their position (QueryScaleConfig, a base of
it; mp's fields, Megatron-LM has none) and its check: `check_query_scale`, from
__post_init__. Every message names the field and the value.

Ministral 3 (Hugging Face's rope_parameters llama_4_scaling_beta, with YaRN's
original_max_position_embeddings as the length) multiplies every rotating layer's query
at position p, after its rotation, by

    1 + query_log_scale_beta ln(1 + floor(p / query_log_scale_length))

which is 1 before position query_log_scale_length and grows by steps of that many
positions after it (the long-context queries sharpened as their keys multiply). Llama 4's
temperature (attn_temperature_floor_scale) is the same kind of factor on its layers
without rotary embeddings, from p + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["QueryScaleConfig", "check_query_scale"]


@dataclass(kw_only=True)
class QueryScaleConfig:
    query_log_scale_beta: float | None = None
    """Multiply every rotating layer's query at position p, after its rotation, by
    1 + beta ln(1 + floor(p / query_log_scale_length)) (Ministral 3's llama_4_scaling_beta).
    None: no scaling."""

    query_log_scale_length: int = 16384
    """The positions of each step of query_log_scale_beta's scaling (Ministral 3's YaRN
    original_max_position_embeddings)."""


def check_query_scale(config: TransformerConfig) -> None:
    beta = config.query_log_scale_beta
    if beta is None:
        if config.query_log_scale_length != 16384:
            raise ValueError(f"query_log_scale_length={config.query_log_scale_length!r} "
                             "needs query_log_scale_beta")  # fmt: skip
        return
    if (
        isinstance(beta, bool)
        or not isinstance(beta, (int, float))
        or not (math.isfinite(beta) and beta > 0)
    ):
        raise ValueError(f"query_log_scale_beta={beta!r} must be a finite number > 0")
    positive("query_log_scale_length", config.query_log_scale_length)
    if config.position_embedding_type not in ("rope", "yarn") or config.multi_latent_attention:
        raise ValueError(
            f"query_log_scale_beta={beta!r} scales the queries of the rotating layers: it "
            "needs position_embedding_type 'rope' or 'yarn' without multi_latent_attention, "
            f"got {config.position_embedding_type!r}"
        )
    for name in ("window_rotary_base", "attn_temperature_floor_scale"):
        if getattr(config, name) is not None:
            raise ValueError(f"query_log_scale_beta={beta!r} with {name}="
                             f"{getattr(config, name)!r} is not implemented")  # fmt: skip
