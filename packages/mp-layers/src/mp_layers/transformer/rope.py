"""Rotary position embeddings (Su et al., 2021, RoFormer), in Megatron's layout.

Shapes: s sequence, b batch, n heads, d head channels ([s, b, n, d], as
Megatron's attention). The first rot = int(d * rotary_percent) channels of
each head are rotated, the rest pass through. Channel pairs are (i, i + rot/2)
("rotate half", GPT-NeoX and Hugging Face Llama), or with `interleaved` (Megatron's
--rotary-interleaved; Meta's original Llama code and Llama 4, whose complex-number
rotation turns x[2i] + i x[2i+1]) the neighbours (2i, 2i + 1); pair i turns at the
frequency base^(-2i/rot) either way. Positions are divided by seq_len_interpolation_factor.

Llama 3.1 rescales those frequencies for a longer context (Llama3Scaling,
Megatron's --use-rope-scaling, Hugging Face's rope_type "llama3"): with L the
original context length, a frequency whose wavelength 2 pi / f exceeds
L / low_freq_factor is divided by factor; one whose wavelength is under
L / high_freq_factor is kept; in between, with
t = (L / wavelength - low) / (high - low), it becomes (1 - t) f / factor + t f.

YaRN (Peng et al., 2023; Megatron's --position-embedding-type yarn, Hugging Face's
rope_type "yarn") blends by channel instead: with L the original context and s the
factor, channel pair i turns L f_i / 2 pi times over L; the pairs turning more than
beta_fast times keep f_i, those turning fewer than beta_slow times get f_i / s, and a
linear ramp over the pair index blends between (its ends rounded to integers unless
told not to). cos and sin are multiplied by the attention factor
(0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1), 1 for s <= 1, which scales
every attention logit by its square. Multi-latent attention (DeepSeek) multiplies its
softmax scale by (0.1 mscale_all_dim ln s + 1)^2 besides (multi_latent_attention.py), so that
with mscale = mscale_all_dim the rotary and the other channels alike get that factor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mp_layers.config import TransformerConfig
from mp_layers.config_attention import uses_yarn

__all__ = [
    "Llama3Scaling",
    "Rotary",
    "RotaryEmbedding",
    "YarnScaling",
    "apply_rotary_pos_emb",
    "llama3_scaled",
    "yarn_frequencies",
    "yarn_mscale",
    "yarn_scaling",
]


class Llama3Scaling(NamedTuple):
    """The settings of Llama 3.1's frequency rescaling (defaults: Megatron's)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    """The frequencies inv_freq [rot/2] rescaled as Llama 3.1 does (module docstring)."""
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq  # in between
    scaled = torch.where(wavelength < context / scaling.high_freq_factor, inv_freq, scaled)
    return torch.where(wavelength > context / scaling.low_freq_factor,
                       inv_freq / scaling.factor, scaled)  # fmt: skip


class YarnScaling(NamedTuple):
    """YaRN's settings (defaults: Megatron's)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True


def yarn_frequencies(rot: int, base: float, scaling: YarnScaling) -> tuple[torch.Tensor, float]:
    """The frequencies [rot/2] of rot rotated channels under YaRN (module docstring), and
    the attention factor that multiplies cos and sin."""
    powers = base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    kept, divided = 1.0 / powers, 1.0 / (scaling.factor * powers)
    context = scaling.original_max_position_embeddings

    def pair_turning(turns: float) -> float:  # the (fractional) pair index turning `turns` times
        return rot * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp = ((torch.arange(rot // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the frequency kept, 0: divided by the factor
    inv_freq = divided * (1 - keep) + kept * keep

    factor = scaling.factor
    attention_factor = yarn_mscale(factor, scaling.mscale) / yarn_mscale(
        factor, scaling.mscale_all_dim
    )
    return inv_freq, attention_factor


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 mscale ln(factor) + 1, 1 for factor <= 1 (Megatron's _yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(config: TransformerConfig) -> YarnScaling | None:
    """The YaRN settings of a config (position_embedding_type "yarn", or multi-latent
    attention's rope_type "yarn"), else None."""
    if not uses_yarn(config):
        return None
    return YarnScaling(
        config.yarn_rotary_scaling_factor, config.yarn_original_max_position_embeddings,
        config.yarn_beta_fast, config.yarn_beta_slow, config.yarn_mscale,
        config.yarn_mscale_all_dim, config.yarn_correction_range_round_to_int,
    )  # fmt: skip


class Rotary(NamedTuple):
    """cos and sin of the rotation angles, each [s, 1, 1, rot] in fp32 ([s, b, 1, rot]
    when each sequence has positions of its own); channel c's angle is pair c mod rot/2's
    (c // 2's when interleaved).

    Computed once per forward and shared by every layer's attention.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    query_scale: torch.Tensor | None = None
    """[s, 1 or b, 1, 1] fp32: the factor of the queries of the layers without rotary
    embeddings (Llama 4's temperature tuning), or None."""
    chosen: dict | None = None
    """With DeepSeek sparse attention shared across layers (dsa_indexer_topk_freq > 1): the
    positions each computing layer chose in this forward, by layer number, for the layers
    that reuse them (GPTModel gives each forward a new dict); None otherwise."""
    window: Rotary | None = None
    """With window_rotary_base: the rotations of the layers that attend through the window
    (plain RoPE of that base), which take them instead; None otherwise."""
    rotated_query_scale: torch.Tensor | None = None
    """[s, 1 or b, 1, 1] fp32: the factor of the rotating layers' queries after their
    rotation (query_log_scale_beta: Ministral 3's), or None."""


class RotaryEmbedding(torch.nn.Module):
    """The rotations for positions offset .. offset+s-1: forward(s) -> Rotary."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: float = 10000,
        seq_len_interpolation_factor: float | None = None,
        llama3_scaling: Llama3Scaling | None = None,
        yarn: YarnScaling | None = None,
        interleaved: bool = False,
        temperature: tuple[int, float] | None = None,
        query_log_scale: tuple[float, int] | None = None,
    ) -> None:
        """temperature: (floor_scale, attn_scale) of Llama 4's query scaling on the
        layers without rotary embeddings (Rotary.query_scale), or None; query_log_scale:
        (beta, length) of the rotating layers' (Rotary.rotated_query_scale), or None."""
        super().__init__()
        self.interleaved = interleaved
        self.temperature = temperature
        self.query_log_scale = query_log_scale
        rot = int(kv_channels * rotary_percent)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"kv_channels={kv_channels} x rotary_percent={rotary_percent} gives {rot} "
                "rotated channels; it must be even and >= 2"
            )
        exponents = torch.arange(0, rot, 2, dtype=torch.float32) / rot
        inv_freq = 1.0 / (rotary_base**exponents)
        if llama3_scaling is not None:
            inv_freq = llama3_scaled(inv_freq, llama3_scaling)
        self.attention_factor = 1.0
        """Multiplies cos and sin (YaRN's; 1 otherwise)."""
        if yarn is not None:
            inv_freq, self.attention_factor = yarn_frequencies(rot, rotary_base, yarn)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def forward(self, seq_len: int, offset: int = 0) -> Rotary:
        positions = torch.arange(offset, offset + seq_len, device=self.inv_freq.device)
        return self.at(positions[:, None])  # [s, 1, 1, rot]

    def at(self, positions: torch.Tensor) -> Rotary:
        """The rotations of positions [s, b] (each sequence its own): cos and sin
        [s, b, 1, rot]."""
        positions = positions.to(self.inv_freq.device, torch.float32)
        query_scale = None
        if self.temperature is not None:  # 1 + scale ln(1 + floor((p + 1) / floor_scale))
            floor_scale, scale = self.temperature
            steps = torch.floor((positions + 1.0) / floor_scale)
            query_scale = (torch.log1p(steps) * scale + 1.0)[:, :, None, None]
        rotated_query_scale = None
        if self.query_log_scale is not None:  # 1 + beta ln(1 + floor(p / length))
            beta, length = self.query_log_scale
            steps = torch.floor(positions / length)
            rotated_query_scale = (torch.log1p(steps) * beta + 1.0)[:, :, None, None]
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = positions[..., None] * self.inv_freq  # [s, b, rot/2]
        if self.interleaved:  # f0 f0 f1 f1 ...
            angles = angles.repeat_interleave(2, dim=-1)[:, :, None, :]
        else:  # f0 f1 ... f0 f1 ...
            angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return Rotary(cos, sin, query_scale, rotated_query_scale=rotated_query_scale)


def apply_rotary_pos_emb(
    t: torch.Tensor, rotary: Rotary, interleaved: bool = False
) -> torch.Tensor:
    """Rotates the first rot channels of t [s, b, n, d] (rot = rotary.cos.shape[-1]) in
    pairs (i, i + rot/2), or (2i, 2i + 1) when interleaved (rotary from a RotaryEmbedding
    with the same interleaved)."""
    rot = rotary.cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = rotary.cos.to(t.dtype), rotary.sin.to(t.dtype)
    if interleaved:  # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        rotated = torch.stack([-t_rot[..., 1::2], t_rot[..., ::2]], dim=-1).flatten(-2)
    else:  # (first, second) -> (-second, first)
        first, second = t_rot.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
    out = t_rot * cos + rotated * sin
    return out if rot == t.shape[-1] else torch.cat([out, t_pass], dim=-1)
