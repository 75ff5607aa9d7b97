"""TransformerConfig's linear-attention fields (LinearAttentionConfig, a base of it; Megatron's
--experimental-attention-variant, --linear-attention-freq and --linear-*: Qwen3-Next's
gated DeltaNet layers), and `linear_attention_layer_pattern`, which layers take it.

A model with experimental_attention_variant "gdn" is a GPT model whose layers are
attention then an MLP (or MoE), as every other; the attention of the linear_attention_freq
layers is a gated DeltaNet (transformer/gated_delta_net.py), the others' softmax
attention. A multi-token prediction module's layer is shaped as the model's last. A hybrid
model's G layers (config_hybrid.py) are gated DeltaNets too, of the same linear_* widths,
without experimental_attention_variant (Megatron's HybridModel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "LinearAttentionConfig",
    "check_linear_attention",
    "check_linear_attention_parallel",
    "has_gated_delta_nets",
    "linear_attention_layer_pattern",
]


@dataclass(kw_only=True)
class LinearAttentionConfig:
    """Linear attention (Megatron's --experimental-attention-variant, --linear-*): a base
    of TransformerConfig, checked by `check_linear_attention`."""

    experimental_attention_variant: Literal["gdn", "gated_delta_net", "dsa"] | None = None
    """Megatron's --experimental-attention-variant: "gdn" (or its alias "gated_delta_net")
    makes the attention of the linear_attention_freq layers a gated DeltaNet (Qwen3-Next;
    Yang et al. 2024, transformer/gated_delta_net.py); "dsa" gives every multi-latent
    attention layer DeepSeek's sparse attention (DeepSeek-V3.2; the dsa_* fields,
    config_dsa.py). None: every layer has softmax attention over all earlier positions.
    Megatron's "gdn2" is refused, naming it."""

    linear_attention_freq: int | list[int] | None = None
    """Which layers take the linear attention (Megatron's --linear-attention-freq): an
    integer N, N - 1 linear-attention layers then one softmax-attention layer, repeated
    (Qwen3-Next: 4); or one value per layer, 1 linear and 0 softmax attention ("([1]*3+[0])*12"
    on the command line). Needed with experimental_attention_variant."""

    linear_conv_kernel_dim: int = 4
    """The gated DeltaNet's causal convolution width over q, k and v (Megatron's)."""

    linear_key_head_dim: int = 128
    """Channels of each gated DeltaNet query and key head."""

    linear_value_head_dim: int = 128
    """Channels of each gated DeltaNet value (and output gate) head."""

    linear_num_key_heads: int = 16
    """Gated DeltaNet query and key heads; each serves linear_num_value_heads /
    linear_num_key_heads consecutive value heads."""

    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads, each with its own decay and write strength."""


_REFUSED = {
    "gdn2": "the gated DeltaNet-2 variant",
}
"""Megatron's other variants, refused naming what they are."""


def has_gated_delta_nets(config: TransformerConfig) -> bool:
    """Whether the model has gated DeltaNets: linear_attention_freq layers, or a hybrid
    pattern's G layers (decoder or multi-token prediction modules)."""
    pattern = config.hybrid_layer_pattern
    return any(linear_attention_layer_pattern(config)) or bool(pattern and "G" in pattern)


def linear_attention_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Per decoder layer: whether its attention is the linear attention (Megatron's rule: an
    integer N makes layer i softmax attention where (i + 1) % N == 0)."""
    freq, n = config.linear_attention_freq, config.num_layers
    if config.experimental_attention_variant in (None, "dsa"):
        return [False] * n
    if isinstance(freq, int) and not isinstance(freq, bool):
        return [(i + 1) % freq != 0 for i in range(n)]
    return [bool(x) for x in freq]


def check_linear_attention(config: TransformerConfig) -> None:
    variant, freq = config.experimental_attention_variant, config.linear_attention_freq
    if variant in (None, "dsa"):  # "dsa": config_dsa.py
        if freq is not None:
            raise ValueError(f"linear_attention_freq={freq!r} needs "
                             "experimental_attention_variant='gdn'")  # fmt: skip
        if has_gated_delta_nets(config):  # a hybrid pattern's G layers
            _check_widths(config)
        return
    if variant in _REFUSED:
        raise ValueError(f"experimental_attention_variant={variant!r} ({_REFUSED[variant]}) is "
                         "not implemented; mp builds 'gdn' (gated DeltaNet) and 'dsa'")  # fmt: skip
    if variant == "gated_delta_net":  # Megatron's deprecated alias
        config.experimental_attention_variant = variant = "gdn"
    if variant != "gdn":
        raise ValueError(f"experimental_attention_variant={variant!r} must be 'gdn' "
                         "(or its alias 'gated_delta_net') or 'dsa'")  # fmt: skip
    if freq is None:
        raise ValueError(
            "experimental_attention_variant='gdn' needs linear_attention_freq (e.g. 4: three "
            "gated DeltaNet layers, then softmax attention)"
        )
    if isinstance(freq, int) and not isinstance(freq, bool):
        positive("linear_attention_freq", freq)
    elif (not isinstance(freq, list | tuple) or len(freq) != config.num_layers
          or any(x not in (0, 1) or isinstance(x, bool) for x in freq)):  # fmt: skip
        raise ValueError(f"linear_attention_freq={freq!r} must be a positive integer or "
                         f"{config.num_layers} values (num_layers) of 0 or 1")  # fmt: skip
    _check_widths(config)
    refused = {"multi_latent_attention": config.multi_latent_attention,
               "hybrid_layer_pattern": config.hybrid_layer_pattern}  # fmt: skip
    for name, value in refused.items():
        if value:
            raise ValueError(f"{name}={value!r} with experimental_attention_variant='gdn' is "
                             "not implemented")  # fmt: skip


def _check_widths(config: TransformerConfig) -> None:
    """The DeltaNets' widths, and the activation: Megatron's GatedDeltaNet convolves with the
    model's activation function and accepts silu alone (swiglu's), as mp's does."""
    if config.activation != "swiglu":
        raise ValueError(
            f"activation={config.activation!r} with gated DeltaNet layers: Megatron's "
            "GatedDeltaNet convolves q, k and v with the model's activation function and "
            "accepts only silu (activation='swiglu')"
        )
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):  # fmt: skip
        positive(name, getattr(config, name))
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_key_heads={config.linear_num_key_heads} does not divide "
            f"linear_num_value_heads={config.linear_num_value_heads}: each key head serves "
            "whole value heads"
        )


def check_linear_attention_parallel(config: TransformerConfig, tp: int, cp: int) -> None:
    """Tensor parallelism splits a gated DeltaNet by whole key heads (with their value
    heads), and context parallelism each tensor-parallel rank's key heads again (the
    all-to-all of gated_delta_net.py): Megatron's rule, key heads divisible by tp x cp."""
    if not has_gated_delta_nets(config):
        return
    if config.linear_num_key_heads % tp:
        raise ValueError(
            f"linear_num_key_heads={config.linear_num_key_heads} is not divisible by "
            f"tensor_model_parallel_size={tp}: each rank holds whole gated DeltaNet key heads"
        )
    if config.linear_num_key_heads % (tp * cp):
        raise ValueError(
            f"linear_num_key_heads={config.linear_num_key_heads} is not divisible by "
            f"tensor_model_parallel_size x context_parallel_size={tp * cp}: each context-"
            "parallel rank mixes whole gated DeltaNet key heads of the whole sequence"
        )
