"""TransformerConfig's norm placement fields (NormPlacementConfig, a base of it) and their
checks: `check_norm_placement`, from __post_init__, and `check_norm_placement_parallel`,
from check_parallel. Every message names the field and the value.

    sublayer_norm "input" (pre-norm, Megatron's only placement):
        x = x + sublayer(norm(x))
    "output" (OLMo 2's and OLMo 3's):
        x = x + norm(sublayer(x))
    "both" (Gemma 2's and Gemma 3's sandwich):
        x = x + norm(sublayer(norm(x)))

qk_layernorm_scope "all_heads" (OLMo 2's): each position's queries are normalized over
all query heads together (one RMS over num_attention_heads x kv_channels channels, a
weight per channel), its keys over all key heads; under tensor parallelism the ranks'
sums of squares are added up (mp_layers.transformer.all_heads_norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mp_layers.config_rules import choice

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["NormPlacementConfig", "check_norm_placement", "check_norm_placement_parallel"]


@dataclass(kw_only=True)
class NormPlacementConfig:
    """Where a layer's norms sit (mp's fields; Megatron-LM places norms before each
    sublayer only and normalizes queries and keys per head): a base of TransformerConfig."""

    sublayer_norm: Literal["input", "output", "both"] = "input"
    """Which side of each attention and MLP sublayer is normalized: its input (pre-norm,
    Megatron-LM's; input_layernorm, pre_mlp_layernorm), its output before the residual add
    (OLMo 2, OLMo 3; post_self_attn_layernorm, post_mlp_layernorm), or both (Gemma 2 and
    3's sandwich). The final norm is kept in every case. Not in a hybrid model."""

    qk_layernorm_scope: Literal["head", "all_heads"] = "head"
    """With qk_layernorm: normalize each query and key head apart, its weight shared by the
    heads (Qwen3's, Megatron-LM's), or each position's queries over all query heads and its
    keys over all key heads together, a weight per channel (OLMo 2's, MiniMax-M2's). At
    tensor-parallel size > 1 "all_heads" needs as many key heads as ranks at least."""


def check_norm_placement(config: TransformerConfig) -> None:
    choice("sublayer_norm", config.sublayer_norm, ("input", "output", "both"))
    choice("qk_layernorm_scope", config.qk_layernorm_scope, ("head", "all_heads"))
    if config.sublayer_norm != "input" and config.hybrid_layer_pattern is not None:
        raise ValueError(
            f"sublayer_norm={config.sublayer_norm!r} with hybrid_layer_pattern: a hybrid "
            "model's layers normalize their inputs only"
        )
    if config.sublayer_norm == "output" and config.recomputes("layernorm"):
        raise ValueError(
            "recompute_modules 'layernorm' with sublayer_norm='output': the layers have no "
            "input norms to recompute"
        )
    if config.qk_layernorm_scope == "head":
        return
    if not config.qk_layernorm or config.qk_l2_norm:
        raise ValueError(
            "qk_layernorm_scope='all_heads' needs qk_layernorm=True without qk_l2_norm"
        )
    if config.multi_latent_attention:
        raise ValueError(
            "qk_layernorm_scope='all_heads' with multi_latent_attention: its query and "
            "key/value latents have norms of their own"
        )
    if config.normalization != "RMSNorm":
        raise ValueError(
            f"qk_layernorm_scope='all_heads' with normalization={config.normalization!r}: "
            "it is an RMSNorm"
        )


def check_norm_placement_parallel(config: TransformerConfig, tp: int) -> None:
    groups = config.num_query_groups
    if config.qk_layernorm_scope == "all_heads" and groups < tp:
        raise ValueError(
            f"qk_layernorm_scope='all_heads' with num_query_groups={groups} < "
            f"tensor_model_parallel_size={tp}: the keys' norm over ranks sharing a key head "
            "is not implemented"
        )
