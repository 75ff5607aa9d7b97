"""Gated DeltaNet layers (TransformerConfig.experimental_attention_variant "gdn": Qwen3-Next;
a hybrid model's G layers) in mp's estimate: which layers are, and a gated DeltaNet's
parameters, FLOPs and activations. A "linear" layer is a transformer layer whose attention
is the DeltaNet: its norms and its MLP count as a transformer layer's; a hybrid G layer
("gdn") is the DeltaNet and its norm (parameters.py, activations.py, memory_flops.py).

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

Activations: what GatedDeltaNet keeps for backward in training, where it computes the
convolution, the rule and the gated norm again in backward (mp_layers' gated_delta_net.py):
in the run's precision in_proj's input h (whole, as attention's), in_proj's output W (z
and the gates' inputs are views of it), the convolution's inputs X and out_proj's input V
(split over t); in fp32 the gates g and beta and two of their intermediate tensors, 4 Hv.
Checked against the saved tensors themselves (tests/test_estimate_families.py), and the
layer's input norm's input h whole as for attention.
"""

from __future__ import annotations

from mp_layers import TransformerConfig, hybrid_layer_kinds, linear_attention_layer_pattern

__all__ = ["gdn_activation", "gdn_flops", "gdn_parameters", "layer_kinds"]


def layer_kinds(m: TransformerConfig) -> list[str]:
    """mp_layers.hybrid_layer_kinds (a hybrid model's G layer "gdn": a gated DeltaNet and
    its norm), with "linear" for a transformer layer whose attention is a gated DeltaNet
    (then an MLP)."""
    linear = linear_attention_layer_pattern(m)
    return ["linear" if is_linear else kind
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
    sequences of s tokens (module docstring) with its input norm: the first two in the
    16-bit units of the activation formula, the third in fp32 whatever the precision."""
    _, v, width, conv = _widths(m)
    return (
        2 * 2 * s * b * m.hidden_size,
        2 * s * b * (width + conv + v),
        s * b * 4 * 4 * (m.linear_num_value_heads),
    )
