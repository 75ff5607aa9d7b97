"""The causal depthwise convolution (then silu) of Mamba mixers and gated DeltaNet layers.

inputs [b, channels, K - 1 + s] holds the K - 1 positions before the s new ones first (zeros
at a sequence's start, a KVCache's history in generation), so output position t sees
inputs t .. t + K - 1: itself and the K - 1 before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv_silu"]


def causal_conv_silu(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """[b, channels, K - 1 + s], weight [channels, K], bias [channels] or None -> silu of the
    convolution at the s new positions, [b, s, channels], in inputs' dtype. positions [b, s]
    (packed documents): each position's place in its document; a tap reaching back past
    its document's first position is left out."""
    width = weight.shape[-1]
    weight = weight.to(inputs.dtype)
    bias = None if bias is None else bias.to(inputs.dtype)
    if positions is None:
        out = F.conv1d(inputs, weight[:, None, :], bias, groups=inputs.shape[1])
    else:
        s = positions.shape[1]
        out = 0 if bias is None else bias[:, None]
        for k in range(width):  # tap k reaches K - 1 - k positions back
            inside = (positions >= width - 1 - k)[:, None, :]
            out = out + inputs[..., k : k + s] * weight[:, k, None] * inside
    return F.silu(out).transpose(1, 2)
