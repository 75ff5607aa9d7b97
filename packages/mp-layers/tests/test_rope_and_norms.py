"""Rotary embeddings against the complex-number definition; norms from the config."""

import pytest
import torch

from mp_layers import TransformerConfig
from mp_layers.transformer.norms import build_norm
from mp_layers.transformer.rope import (
    Llama3Scaling,
    RotaryEmbedding,
    apply_rotary_pos_emb,
    llama3_scaled,
)


def by_complex_numbers(t, base, rot, factor=1.0):
    """Pairs (i, i + rot/2) as complex numbers, multiplied by e^(i * pos * base^(-2i/rot))."""
    s = t.shape[0]
    half = rot // 2
    pairs = torch.complex(t[..., :half].double(), t[..., half:rot].double())
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    angle = torch.outer(torch.arange(s, dtype=torch.float64) / factor, freqs)[:, None, None, :]
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([turned.real, turned.imag, t[..., rot:].double()], dim=-1)


@pytest.mark.parametrize(("percent", "factor"), [(1.0, None), (0.5, None), (1.0, 4.0)])
def test_rope_equals_the_complex_rotation(percent, factor):
    torch.manual_seed(0)
    t = torch.randn(12, 2, 3, 16)
    rope = RotaryEmbedding(16, rotary_percent=percent, rotary_base=500,
                           seq_len_interpolation_factor=factor)  # fmt: skip
    got = apply_rotary_pos_emb(t, rope(12))
    want = by_complex_numbers(t, 500, int(16 * percent), factor or 1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # Rotations keep each pair's length and the relative angle of two positions.
    assert torch.allclose(got.norm(dim=-1), t.norm(dim=-1), atol=1e-5)


def test_rope_rejects_an_odd_number_of_rotated_channels():
    with pytest.raises(ValueError, match="gives 3 rotated channels"):
        RotaryEmbedding(6, rotary_percent=0.5)


def test_llama3_scaling_keeps_high_divides_low_and_blends_between():
    scaling = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=256)  # fmt: skip
    inv_freq = 1.0 / 500000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    wavelength = 2 * torch.pi / inv_freq
    scaled = llama3_scaled(inv_freq, scaling)
    high, low = wavelength < 256 / 4, wavelength > 256 / 1
    between = ~high & ~low
    assert high.any() and low.any() and between.any()
    assert torch.equal(scaled[high], inv_freq[high])
    assert torch.equal(scaled[low], inv_freq[low] / 8)
    t = (256 / wavelength[between] - 1) / (4 - 1)
    assert torch.allclose(scaled[between], (1 - t) * inv_freq[between] / 8 + t * inv_freq[between])
    rope = RotaryEmbedding(16, rotary_base=500000, llama3_scaling=scaling)
    assert torch.equal(rope.inv_freq, scaled)


def test_llama3_scaling_equals_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                      rope_parameters=parameters)  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    scaling = Llama3Scaling(32.0, 1.0, 4.0, 8192)
    assert torch.equal(RotaryEmbedding(64, rotary_base=500000, llama3_scaling=scaling).inv_freq,
                       want)  # fmt: skip


def test_norms_follow_the_config():
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2)
    rms = build_norm(TransformerConfig(**base, normalization="RMSNorm", layernorm_epsilon=1e-6))
    x = torch.randn(3, 8)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms(x), want)
    ln = build_norm(TransformerConfig(**base, sequence_parallel=True))
    assert isinstance(ln, torch.nn.LayerNorm)
    assert all(p.sequence_parallel for p in ln.parameters())
