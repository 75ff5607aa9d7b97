"""LayerNorm and RMSNorm as the config asks, marked for sequence parallelism.

With sequence parallelism each TP rank normalizes its own slice of the
sequence, so the norm's weight gradients are partial sums: the parameters
carry `sequence_parallel = True`, which tells the finalize step to all-reduce
their gradients over the TP group (Megatron's convention).

apply_layernorm_1p (Megatron's zero-centered gamma, Nemotron's LayerNorm1P): the
weight w is stored centred on 0 and the norm scales by 1 + w, initialized to w = 0, so
that weight decay pulls the scale towards 1 rather than 0. Hugging Face's
NemotronLayerNorm1P stores the same w: checkpoints need no transform.

L2Norm (Llama 4's query and key norm, Megatron's L2Norm) has no weight:
x / sqrt(mean(x^2) + eps), computed in fp32 and returned in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mp_layers.config import TransformerConfig

__all__ = ["L2Norm", "LayerNorm1P", "RMSNorm1P", "build_norm"]


def build_norm(config: TransformerConfig, hidden_size: int | None = None) -> torch.nn.Module:
    """A norm over the last dimension (hidden_size by default)."""
    size = config.hidden_size if hidden_size is None else hidden_size
    one_p = config.apply_layernorm_1p
    if config.normalization == "RMSNorm":
        cls = RMSNorm1P if one_p else torch.nn.RMSNorm
    else:
        cls = LayerNorm1P if one_p else torch.nn.LayerNorm
    norm = cls(size, eps=config.layernorm_epsilon)
    norm.to(dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


class LayerNorm1P(torch.nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) (1 + weight) + bias over the last dimension."""

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1P(torch.nn.RMSNorm):
    """y = x / sqrt(mean(x^2) + eps) (1 + weight) over the last dimension."""

    def reset_parameters(self) -> None:
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class L2Norm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) over the last dimension, in fp32; no parameters."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
