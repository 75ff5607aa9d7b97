"""LayerNorm and RMSNorm as the config asks, marked for sequence parallelism.

With sequence parallelism each TP rank normalizes its own slice of the
sequence, so the norm's weight gradients are partial sums: the parameters
carry `sequence_parallel = True`, which tells the finalize step to all-reduce
their gradients over the TP group (Megatron's convention).
"""

from __future__ import annotations

import torch

from mp_layers.config import TransformerConfig

__all__ = ["build_norm"]


def build_norm(config: TransformerConfig, hidden_size: int | None = None) -> torch.nn.Module:
    """A norm over the last dimension (hidden_size by default)."""
    size = config.hidden_size if hidden_size is None else hidden_size
    if config.normalization == "RMSNorm":
        norm: torch.nn.Module = torch.nn.RMSNorm(size, eps=config.layernorm_epsilon)
    else:
        norm = torch.nn.LayerNorm(size, eps=config.layernorm_epsilon)
    norm.to(dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm
