"""TransformerConfig's embedding, attention, residual and logit scales of Gemma's and
Granite's layers (ScalesConfig, a base of it; mp's fields, Megatron-LM's flags have none)
and their check: `check_scales`, from __post_init__. Every message names the field and
the value.

    scale_word_embeddings      the word embeddings' output times sqrt(hidden_size), the
                               factor rounded to the parameters' dtype first (Gemma's
                               normalizer, as transformers' Gemma3TextScaledWordEmbedding
                               computes it)
    word_embedding_multiplier  the word embeddings' output times it (Granite's
                               embedding_multiplier)
    query_pre_attn_scalar      softmax attention's scale 1 / sqrt(query_pre_attn_scalar)
                               instead of 1 / sqrt(kv_channels) (Gemma's; 256 where its
                               heads are 256 wide; Granite's attention_multiplier 1/128 is
                               16384)
    residual_multiplier        each sublayer's output times it before the residual add
                               (Granite's; a hybrid model's Mamba mixers' too, Granite 4's)
    logits_scaling             the logits divided by it (Granite's)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["ScalesConfig", "check_scales"]


@dataclass(kw_only=True)
class ScalesConfig:
    scale_word_embeddings: bool = False
    """Multiply the word embeddings' output by sqrt(hidden_size), rounded to the
    parameters' dtype (Gemma's normalizer)."""

    query_pre_attn_scalar: int | None = None
    """Scale softmax attention's scores by 1 / sqrt(query_pre_attn_scalar) (Gemma's) instead
    of 1 / sqrt(kv_channels). Not with use_mup (whose attention scale is its own) or
    multi-latent attention. None: 1 / sqrt(kv_channels)."""

    word_embedding_multiplier: float = 1.0
    """Multiply the word embeddings' output by it (Granite's embedding_multiplier). Not
    with use_mup, whose mup_embedding_mult it is."""

    residual_multiplier: float = 1.0
    """Multiply each sublayer's output (attention, MLP, and in a hybrid model the Mamba
    mixers') by it before the residual add (Granite's)."""

    logits_scaling: float = 1.0
    """Divide the logits by it (Granite's). Not with use_mup, whose mup_output_mult sets
    the logits' multiplier."""


def check_scales(config: TransformerConfig) -> None:
    for name in ("word_embedding_multiplier", "residual_multiplier", "logits_scaling"):
        value = getattr(config, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise ValueError(f"{name}={value!r} must be a finite number > 0")
    for name in ("word_embedding_multiplier", "logits_scaling"):
        if config.use_mup and getattr(config, name) != 1.0:
            raise ValueError(f"{name}={getattr(config, name)!r} with use_mup: muP sets the "
                             "embedding's and the logits' multipliers (mup_embedding_mult, "
                             "mup_output_mult)")  # fmt: skip
    scalar = config.query_pre_attn_scalar
    if scalar is None:
        return
    positive("query_pre_attn_scalar", scalar)
    if config.use_mup:
        raise ValueError(
            f"query_pre_attn_scalar={scalar!r} with use_mup: muP's attention scale "
            "(mup_base_head_dim, mup_attn_scale_power) is its own"
        )
    if config.multi_latent_attention:
        raise ValueError(
            f"query_pre_attn_scalar={scalar!r} with multi_latent_attention: its softmax scale "
            "is its own (qk_head_dim, qk_pos_emb_head_dim, YaRN's mscale)"
        )
