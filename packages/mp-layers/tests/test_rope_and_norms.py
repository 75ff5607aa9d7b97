"""Rotary embeddings against the complex-number definition (halves and interleaved pairs);
norms from the config; Llama 4's attention parts (NoPE layers and their query temperature,
the L2 QK norm, chunked attention)."""

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.transformer.attention import SelfAttention
from mp_layers.transformer.chunked_attention import attend_in_blocks, block_mask
from mp_layers.transformer.core_attention import CoreAttention
from mp_layers.transformer.norms import L2Norm, build_norm
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.rope import (
    Llama3Scaling,
    Rotary,
    RotaryEmbedding,
    apply_rotary_pos_emb,
    llama3_scaled,
)
from mp_layers.transformer.spec import get_layer_spec


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


@pytest.mark.parametrize(("percent", "scaling"), [(1.0, None), (0.5, Llama3Scaling(8.0))])
def test_interleaved_rope_turns_neighbouring_channels_as_complex_numbers(percent, scaling):
    """Megatron's --rotary-interleaved, Llama 4's (Meta's) layout: x[2i] + i x[2i+1] times
    e^(i pos f_i), the same frequencies f_i as the halves' layout."""
    torch.manual_seed(0)
    t = torch.randn(12, 2, 3, 16)
    rot = int(16 * percent)
    rope = RotaryEmbedding(16, rotary_percent=percent, rotary_base=500, llama3_scaling=scaling,
                           interleaved=True)  # fmt: skip
    got = apply_rotary_pos_emb(t, rope(12), interleaved=True)
    pairs = torch.view_as_complex(t[..., :rot].double().reshape(12, 2, 3, rot // 2, 2))
    angle = torch.outer(torch.arange(12, dtype=torch.float64), rope.inv_freq.double())
    turned = pairs * torch.polar(torch.ones_like(angle), angle)[:, None, None, :]
    want = torch.cat([torch.view_as_real(turned).flatten(-2), t[..., rot:].double()], dim=-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The same rotation as the halves' layout on the channels reordered (0 2 4 .. 1 3 5 ..).
    order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, 16)])
    halves = RotaryEmbedding(16, rotary_percent=percent, rotary_base=500, llama3_scaling=scaling)
    torch.testing.assert_close(apply_rotary_pos_emb(t[..., order], halves(12)), got[..., order])


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


def test_l2_norm_has_no_weight_and_keeps_the_dtype():
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    got = L2Norm(1e-5)(x)
    x32 = x.float()
    want = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got.dtype == torch.bfloat16 and list(L2Norm(1e-5).parameters()) == []
    torch.testing.assert_close(got, want.bfloat16())


LLAMA4 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              position_embedding_type="rope", rotary_interleaved=True, no_rope_freq=2,
              attention_dropout=0.0, init_method_std=0.2)  # fmt: skip


def attention(layer: int, **settings) -> SelfAttention:
    torch.manual_seed(0)
    return SelfAttention(TransformerConfig(**LLAMA4 | settings), ModelGroups.single(),
                         spec=get_layer_spec("local"), layer_number=layer)  # fmt: skip


def test_nope_layers_ignore_positions_and_rope_layers_rotate_interleaved():
    """--no-rope-freq 2: layers 1 and 3 (0-based) attend without rotary embeddings; the
    others rotate neighbouring pairs."""
    x = torch.randn(6, 2, 32)
    rope = RotaryEmbedding(8, interleaved=True)(6)
    still = Rotary(torch.ones_like(rope.cos), torch.zeros_like(rope.sin))  # no rotation
    for layer, rotates in enumerate([True, False, True, False]):
        module = attention(layer)
        assert module.rotates == rotates
        turned, unturned = module(x, rope)[0], module(x, still)[0]
        assert torch.equal(turned, unturned) != rotates, layer
    halves = attention(0, rotary_interleaved=False)
    assert not torch.allclose(halves(x, RotaryEmbedding(8)(6))[0], attention(0)(x, rope)[0])


@pytest.mark.parametrize("layers", ["all", "rope"])
def test_qk_l2_norm_replaces_qk_layernorm_on_the_layers_it_names(layers):
    """Megatron's precedence (its Llama 4 Scout line gives both flags): no norm weights;
    'rope' leaves the NoPE layers' queries and keys as they are (Llama 4)."""
    x = torch.randn(6, 2, 32)
    rope = RotaryEmbedding(8, interleaved=True)(6)
    for layer in range(4):
        module = attention(layer, qk_l2_norm=True, qk_layernorm=True, qk_l2_norm_layers=layers)
        normed = layers == "all" or layer % 2 == 0
        assert isinstance(module.q_layernorm, L2Norm) == normed
        assert not any("layernorm" in name for name, _ in module.named_parameters())
        assert not any("layernorm" in key for key in module.sharded_state_dict())
        plain = attention(layer)
        assert torch.equal(module(x, rope)[0], plain(x, rope)[0]) != normed


def test_the_nope_layers_query_temperature_is_llama_4s():
    """1 + scale ln(1 + floor((p + 1) / floor_scale)): 1 before position floor_scale - 1."""
    rope = RotaryEmbedding(8, interleaved=True, temperature=(4, 0.5))(12)
    p = torch.arange(12, dtype=torch.float64)
    want = 1 + 0.5 * torch.log(1 + torch.floor((p + 1) / 4))
    assert rope.query_scale.shape == (12, 1, 1, 1)
    torch.testing.assert_close(rope.query_scale.flatten().double(), want)
    assert rope.query_scale[:3].eq(1).all() and rope.query_scale[3] > 1
    assert RotaryEmbedding(8)(12).query_scale is None
    x = torch.randn(12, 2, 32)
    nope, rotary = attention(1, attn_temperature_floor_scale=4), attention(0)
    scaled = Rotary(rope.cos, rope.sin, rope.query_scale)
    out, plain = nope(x, scaled)[0], nope(x, rope._replace(query_scale=None))[0]
    assert torch.equal(out[:3], plain[:3]) and not torch.allclose(out[3:], plain[3:])
    assert torch.equal(rotary(x, scaled)[0], rotary(x, rope._replace(query_scale=None))[0])


def test_the_rotating_layers_query_log_scale_is_ministral_3s():
    """1 + beta ln(1 + floor(p / length)) on the rotated queries: 1 before position length;
    the layers without rotary embeddings take none of it."""
    rope = RotaryEmbedding(8, interleaved=True, query_log_scale=(0.25, 4))(12)
    p = torch.arange(12, dtype=torch.float64)
    want = 1 + 0.25 * torch.log(1 + torch.floor(p / 4))
    assert rope.rotated_query_scale.shape == (12, 1, 1, 1) and rope.query_scale is None
    torch.testing.assert_close(rope.rotated_query_scale.flatten().double(), want)
    assert rope.rotated_query_scale[:4].eq(1).all() and rope.rotated_query_scale[4] > 1
    x = torch.randn(12, 2, 32)
    rotary, nope = attention(0), attention(1)
    plain = rope._replace(rotated_query_scale=None)
    out, unscaled = rotary(x, rope)[0], rotary(x, plain)[0]
    assert torch.equal(out[:4], unscaled[:4]) and not torch.allclose(out[4:], unscaled[4:])
    assert torch.equal(nope(x, rope)[0], nope(x, plain)[0])


@pytest.mark.parametrize("backend", ["flash", "local"])
@pytest.mark.parametrize("s", [4, 11, 12])
def test_chunked_attention_sees_only_its_block(backend, s):
    """The blocks as batch entries (padded) equal each block attended alone and the block
    mask; a sequence within one block is attended whole."""
    torch.manual_seed(0)
    q, k, v = torch.randn(s, 2, 4, 8), torch.randn(s, 2, 2, 8), torch.randn(s, 2, 2, 8)
    core = CoreAttention(0.0, None, backend)
    got = attend_in_blocks(lambda *qkv: core(*qkv), 4, q, k, v)
    alone = torch.cat([core(q[i : i + 4], k[i : i + 4], v[i : i + 4]) for i in range(0, s, 4)])
    torch.testing.assert_close(got, alone)
    positions = torch.arange(s)[None]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    masked = core(q, k, v, causal | block_mask(positions, positions, 4))
    torch.testing.assert_close(got, masked)


def test_chunked_attention_applies_to_the_rotary_layers():
    x = torch.randn(10, 2, 32)
    rope = RotaryEmbedding(8, interleaved=True)(10)
    for layer in range(4):
        chunked, whole = attention(layer, attention_chunk_size=4), attention(layer)
        assert (chunked.chunk is not None) == (layer % 2 == 0)
        got, full = chunked(x, rope)[0], whole(x, rope)[0]
        # The first block sees the same keys either way (computed as a batch of blocks, in
        # another order of the sums).
        torch.testing.assert_close(got[:4], full[:4])
        if layer % 2:
            assert torch.equal(got, full)
        else:
            assert (got[4:] - full[4:]).abs().max() > 1e-3
    packed = PackedSeqParams.from_document_ids(torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(
        ValueError,
        match="attention_chunk_size=4 over sequences of 10 "
        "positions with packed sequences is not implemented",
    ):
        attention(0, attention_chunk_size=4)(x, rope, packed)
