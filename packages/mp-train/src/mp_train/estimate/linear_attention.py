"""Gated DeltaNet layers (TransformerConfig.experimental_attention_variant "gdn": Qwen3-Next)
in mp's estimate: which layers are, and a gated DeltaNet's parameters, FLOPs and
activations. Such a layer is a transformer layer whose attention is the DeltaNet: its norms
and its MLP count as a transformer layer's (parameters.py, memory_flops.py).

Symbols as in mp_train.estimate, and for the DeltaNet (mp_layers' GatedDeltaNet) Hk key
heads of dk channels, Hv value heads of dv channels (linear_num_{key,value}_heads,
linear_{key,value}_head_dim), K the convolution's width, C = 64 the delta rule's chunk;
Q = Hk dk, V = Hv dv, W = 2Q + 2V + 2Hv the width of in_proj (q, k, v, z, beta, alpha) and
X = 2Q + V the convolved channels.

Parameters (checked against GPTModel, tests/test_estimate_families.py): in_proj hW,
conv1d XK, dt_bias and A_log 2Hv, out_proj Vh, split over t (whole key heads per rank);
the output norm's dv (shared by every head) whole on every rank. No biases (Megatron's
layer has none).

FLOPs per token, forward (Megatron-LM's gdn_layer_flops, megatron/training/training.py):
2(hW + KX + 4 Hv dv^2 + Vh), times 3 for forward and backward as every GEMM here. The
delta rule's 4 Hv dv^2 is Megatron's; mp's chunked form also computes the C x C products
of each chunk, Hv C (dk + dv) more a token, left out as Megatron leaves them out.

Activations: an estimate of what GatedDeltaNet keeps for backward, counted from its code
(not measured): its input and the in_proj output (h + W, 16-bit), the convolution's
inputs and outputs (2X), and in fp32 the normalized q and k repeated per value head, v,
the gates, the chunk's decays and triangular systems (Hv (2dk + 2dv + 3C)) and the gated
norm's input and gate (2V).
"""

from __future__ import annotations

from mp_layers import TransformerConfig, hybrid_layer_kinds, linear_attention_layer_pattern

__all__ = ["DELTA_CHUNK", "gdn_activation", "gdn_flops", "gdn_parameters", "layer_kinds"]

DELTA_CHUNK = 64
"""C, the delta rule's chunk (mp_layers.transformer.gated_delta_net.DELTA_CHUNK)."""


def layer_kinds(m: TransformerConfig) -> list[str]:
    """mp_layers.hybrid_layer_kinds, with "gdn" for a transformer layer whose attention is
    a gated DeltaNet."""
    linear = linear_attention_layer_pattern(m)
    return ["gdn" if is_linear else kind
            for kind, is_linear in zip(hybrid_layer_kinds(m), linear, strict=True)]  # fmt: skip


def _widths(m: TransformerConfig) -> tuple[int, int, int, int]:
    """(Q, V, W, X) of the module docstring."""
    q = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    return q, v, 2 * q + 2 * v + 2 * m.linear_num_value_heads, 2 * q + v


def gdn_parameters(m: TransformerConfig, norm: int) -> tuple[int, int]:
    """(split over t, whole on every tensor-parallel rank) of one gated DeltaNet, without
    the layer's norms; `norm`: a norm's parameters per channel (1 RMSNorm, 2 LayerNorm)."""
    h = m.hidden_size
    _, v, width, conv = _widths(m)
    split = h * width + conv * m.linear_conv_kernel_dim + 2 * m.linear_num_value_heads + v * h
    return split, norm * m.linear_value_head_dim


def gdn_flops(m: TransformerConfig) -> int:
    """Forward and backward FLOPs of one gated DeltaNet per token (module docstring)."""
    h = m.hidden_size
    _, v, width, conv = _widths(m)
    rule = 4 * m.linear_num_value_heads * m.linear_value_head_dim**2
    return 3 * 2 * (h * width + m.linear_conv_kernel_dim * conv + rule + v * h)


def gdn_activation(m: TransformerConfig, s: float, b: int) -> tuple[float, float, float]:
    """(whole, split, split fp32) bytes one gated DeltaNet keeps for a micro-batch of b
    sequences of s tokens (module docstring): the first two in the 16-bit units of the
    activation formula, the third in fp32 whatever the precision."""
    _, v, width, conv = _widths(m)
    hv, dk, dv = m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    fp32 = s * b * 4 * (hv * (2 * dk + 2 * dv + 3 * DELTA_CHUNK) + 2 * v)
    return 2 * s * b * m.hidden_size, s * b * 2 * (width + 2 * conv), fp32
