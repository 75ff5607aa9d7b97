"""TransformerConfig's embedding and attention scales of Gemma's layers (ScalesConfig, a
base of it; mp's fields, Megatron-LM's flags have neither) and their check:
`check_scales`, from __post_init__. Every message names the field and the value.

    scale_word_embeddings   the word embeddings' output times sqrt(hidden_size), the factor
                            rounded to the parameters' dtype first (Gemma's normalizer, as
                            transformers' Gemma3TextScaledWordEmbedding computes it)
    query_pre_attn_scalar   softmax attention's scale 1 / sqrt(query_pre_attn_scalar)
                            instead of 1 / sqrt(kv_channels) (Gemma's; 256 where its heads
                            are 256 wide, hidden_size / heads for Gemma 2's and 3's 27B)
"""

from __future__ import annotations

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


def check_scales(config: TransformerConfig) -> None:
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
