"""The layers of a Mamba-hybrid model (TransformerConfig.hybrid_layer_pattern: Nemotron-H,
Nemotron-Nano-9B-v2, Nemotron 3) in mp's estimate: which kind each layer is, and a Mamba
layer's parameters, FLOPs and activations. The other kinds count their one sublayer as a
transformer layer counts it (parameters.py, activations.py, memory_flops.py): * attention
and its norm, - a dense MLP and its norm, E a MoE MLP and its norm.

Symbols as in mp_train.estimate, and for the Mamba mixers (mp_layers' MambaMixer) H heads
of P channels (mamba_num_heads, mamba_head_dim; without mamba_num_heads Megatron's inner
width 2h in heads of P), I = H P the inner width, G groups (mamba_num_groups), N the state
size (mamba_state_dim), K = 4 the convolution's width, Q = 128 the scan's chunk, and
W = 2I + 2GN + H the width of in_proj (z, x, B, C, dt), X = I + 2GN the convolved channels.

Parameters of a Mamba layer (checked against GPTModel, tests/test_estimate_families.py):
its norm h (2h LayerNorm) and with add_bias_linear out_proj's bias h, whole on every
tensor-parallel rank; in_proj hW (+ W bias), conv1d XK + X, dt_bias, A_log and D 3H, the
gated norm's weight I and out_proj Ih, split over t (whole groups of heads per rank).

FLOPs per token, forward (Megatron-LM's mamba_layer_flops in num_floating_point_operations,
megatron/training/training.py, hybrid_flops; the same in megatron-core 0.19 and main):

    in_proj   2hW        the GEMM h -> (z, x, B, C, dt)
    scan      7IN        Megatron's estimate of the selective scan
    out_proj  2Ih

times 3 for forward and backward (the GEMM convention of the other layers: 2 FLOPs a
multiply-add, each GEMM once forward and twice backward). Megatron takes d_in = 2h even
when mamba_num_heads sets another width (Nemotron-Nano-9B-v2: 128 x 80 = 10240 for 2h =
8960); mp takes the layer's I, the same figure wherever I = 2h (Nemotron-H 8B and 56B).
Left out, as Megatron does: the causal convolution 2KX, the gated norm, softplus and the
exponentials (elementwise work, < 0.1% of a layer). The scan's 7IN is Megatron's, kept so
that MFU compares with Megatron's logs; what the chunked state-space-duality form
(mp_layers' ssd.py, Dao and Gu 2024) computes, per head and position, is the C_i . B_j
scores of its chunk 2QN, their product with the inputs 2QP, the chunk's state from its
inputs 2NP and the states' readout 2NP: H(2QN + 2QP + 4NP) = I(2QN/P + 2Q + 4N), the full
Q x Q blocks as computed. At Nemotron-H 8B's N = 128, P = 64 that is 1280 I for Megatron's
896 I, 1.4% of the layer's FLOPs (in_proj and out_proj 219 MFLOP a token at h = 4096);
Megatron's own note says its scan term predates the SSD kernels.

Activations of a Mamba layer (Megatron's report_theoretical_memory has no hybrid form: "not
yet supported"): what mp's MambaLayer keeps for backward, counted from its code. In
training its convolution, scan and gated norm keep only their inputs and run again in
backward (as mamba_ssm's fused kernel), so per token: in the model's 16-bit precision the
norm's and in_proj's inputs 2h + 2h and the dropout mask h, which tensor parallelism
leaves whole (5h, as attention's or an MLP's 5h), and split over t the convolution's
input 2X, in_proj's output 2W (the gate z, a view of it, keeps it whole) and out_proj's
input 2I; in fp32 whatever the precision dt before and after its softplus 8H, split over
t. With sequence parallelism the 5h is divided by t too. ci/bench/bench_mamba_recompute.py
measures a bf16 layer of h = 256, H = 16, P = 32, N = 64 keeping 7.8 kB a token (saved-tensor
hooks), where this count gives 6.6 kB (the layer norm keeps fp32 copies); without the
recompute it keeps 72 kB, mostly the scan's Q x Q blocks.
"""

from __future__ import annotations

from mp_layers import CONV_WIDTH, TransformerConfig, mamba_widths

__all__ = ["mamba_activation", "mamba_flops", "mamba_parameters"]


def _widths(m: TransformerConfig) -> tuple[int, int, int, int]:
    """(H, I, W, X): heads, inner width, in_proj's width, the convolved channels."""
    heads, inner = mamba_widths(m)
    bc = 2 * m.mamba_num_groups * m.mamba_state_dim  # B and C
    return heads, inner, 2 * inner + bc + heads, inner + bc


def mamba_parameters(m: TransformerConfig, norm: int) -> tuple[int, int]:
    """(split over t, whole on every tensor-parallel rank) of one Mamba layer; `norm`: a
    norm's parameters per channel (1 RMSNorm, 2 LayerNorm)."""
    h = m.hidden_size
    heads, inner, width, conv = _widths(m)
    bias = 1 if m.add_bias_linear else 0
    split = (h + bias) * width + conv * (CONV_WIDTH + 1) + 3 * heads + inner + inner * h
    return split, norm * h + bias * h


def mamba_flops(m: TransformerConfig) -> int:
    """Forward and backward FLOPs of one Mamba layer per token (module docstring)."""
    h = m.hidden_size
    _, inner, width, _ = _widths(m)
    return 3 * (2 * h * width + 7 * inner * m.mamba_state_dim + 2 * inner * h)


def mamba_activation(m: TransformerConfig, s: int, b: int) -> tuple[float, float, float]:
    """(whole, split, split fp32) bytes one Mamba layer keeps for a micro-batch of b
    sequences of s tokens (module docstring): the first two in the 16-bit units of the
    activation formula, the third in fp32 whatever the precision."""
    heads, inner, width, conv = _widths(m)
    return 5 * s * b * m.hidden_size, s * b * (2 * conv + 2 * width + 2 * inner), s * b * 8 * heads
