"""Layer specs: which implementation each submodule of a transformer layer uses.

The layer names *what* it has (attention with its core, an MLP, norms); the
spec picks *which* implementation, the config which kind (multi-latent attention or not,
MoE or dense MLP). Model code has no branches on the
backend: another backend is another spec with the same constructor
signatures. `local` (pure torch: SDPA or blocked core attention as
TransformerConfig.attention_backend says, torch norms) always works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mp_layers.config import TransformerConfig
from mp_layers.moe.moe_layer import MoELayer
from mp_layers.transformer.attention import SelfAttention
from mp_layers.transformer.core_attention import CoreAttention
from mp_layers.transformer.gated_delta_net import GatedDeltaNet
from mp_layers.transformer.mlp import MLP
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_layers.transformer.norms import build_norm

__all__ = ["LOCAL_SPEC", "LayerSpec", "get_layer_spec"]


@dataclass(frozen=True)
class LayerSpec:
    name: str
    self_attention: type = SelfAttention
    """The attention of a layer, built as cls(config, groups, rng_tracker, spec=spec,
    layer_number=...); called as (x, rotary, attention_mask, kv_cache) -> (output, bias)."""

    multi_latent_attention: type = MultiLatentAttention
    """The attention of a layer with TransformerConfig.multi_latent_attention; built and
    called as self_attention."""

    linear_attention: type = GatedDeltaNet
    """The attention of the layers TransformerConfig.experimental_attention_variant turns to
    linear attention (linear_attention_layer_pattern); built and called as self_attention."""

    core_attention: type = CoreAttention
    """Built as cls(attention_dropout, rng_tracker, attention_backend, cp_group=...,
    cp_comm_type=..., softmax_type=..., window=..., heads=..., params_dtype=...,
    softmax_scale=...), each keyword optional; called as (q, k, v, attention_mask)."""

    mlp: type = MLP
    """Built as cls(config, tp_group); called as (x) -> (output, bias)."""

    moe: type = MoELayer
    """The MLP of a mixture-of-experts layer (TransformerConfig.moe_layer_pattern), built as
    cls(config, groups, rng_tracker); called as (x) -> (output, bias)."""

    norm: Callable[[TransformerConfig, int | None], torch.nn.Module] = build_norm
    """norm(config, hidden_size) for the layer norms, the final norm and QK norms."""


LOCAL_SPEC = LayerSpec("local")
_SPECS = {"local": LOCAL_SPEC}


def get_layer_spec(spec: str | LayerSpec) -> LayerSpec:
    """A spec by name ("local"), or the spec itself."""
    if isinstance(spec, LayerSpec):
        return spec
    if spec not in _SPECS:
        raise ValueError(f"unknown layer spec {spec!r}; available: {', '.join(sorted(_SPECS))}")
    return _SPECS[spec]
