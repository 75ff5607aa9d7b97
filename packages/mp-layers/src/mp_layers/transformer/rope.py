"""Rotary position embeddings (Su et al., 2021, RoFormer), in Megatron's layout.

Shapes: s sequence, b batch, n heads, d head channels ([s, b, n, d], as
Megatron's attention). The first rot = int(d * rotary_percent) channels of
each head are rotated, the rest pass through. Channel pairs are (i, i + rot/2)
("rotate half", GPT-NeoX and Hugging Face Llama), with frequencies
base^(-2i/rot); positions are divided by seq_len_interpolation_factor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Rotary", "RotaryEmbedding", "apply_rotary_pos_emb"]


class Rotary(NamedTuple):
    """cos and sin of the rotation angles, each [s, 1, 1, rot] in fp32.

    Computed once per forward and shared by every layer's attention.
    """

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(torch.nn.Module):
    """The rotations for positions offset .. offset+s-1: forward(s) -> Rotary."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        seq_len_interpolation_factor: float | None = None,
    ) -> None:
        super().__init__()
        rot = int(kv_channels * rotary_percent)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"kv_channels={kv_channels} x rotary_percent={rotary_percent} gives {rot} "
                "rotated channels; it must be even and >= 2"
            )
        exponents = torch.arange(0, rot, 2, dtype=torch.float32) / rot
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents), persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, seq_len: int, offset: int = 0) -> Rotary:
        positions = torch.arange(offset, offset + seq_len, device=self.inv_freq.device,
                                 dtype=torch.float32)  # fmt: skip
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = torch.outer(positions, self.inv_freq)  # [s, rot/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [s, 1, 1, rot]
        return Rotary(angles.cos(), angles.sin())


def apply_rotary_pos_emb(t: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotates the first rot channels of t [s, b, n, d] (rot = rotary.cos.shape[-1])."""
    rot = rotary.cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = rotary.cos.to(t.dtype), rotary.sin.to(t.dtype)
    first, second = t_rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    out = t_rot * cos + rotated * sin
    return out if rot == t.shape[-1] else torch.cat([out, t_pass], dim=-1)
