"""Rotary position embeddings (Su et al., 2021, RoFormer), in Megatron's layout.

Shapes: s sequence, b batch, n heads, d head channels ([s, b, n, d], as
Megatron's attention). The first rot = int(d * rotary_percent) channels of
each head are rotated, the rest pass through. Channel pairs are (i, i + rot/2)
("rotate half", GPT-NeoX and Hugging Face Llama), with frequencies
base^(-2i/rot); positions are divided by seq_len_interpolation_factor.
"""

from __future__ import annotations

import torch

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


class RotaryEmbedding(torch.nn.Module):
    """The rotation angles for positions 0 .. s-1: forward(s) -> [s, 1, 1, rot]."""

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

    def forward(self, seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(offset, offset + seq_len, device=self.inv_freq.device,
                                 dtype=torch.float32)  # fmt: skip
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = torch.outer(positions, self.inv_freq)  # [s, rot/2]
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [s, 1, 1, rot]


def apply_rotary_pos_emb(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotates the first angles.shape[-1] channels of t [s, b, n, d] by `angles`."""
    rot = angles.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = angles.cos().to(t.dtype), angles.sin().to(t.dtype)
    first, second = t_rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return torch.cat([t_rot * cos + rotated * sin, t_pass], dim=-1)
