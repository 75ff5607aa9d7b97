"""Nemotron's parts: LayerNorm1P (apply_layernorm_1p), squared ReLU (relu2) and partial
rotary embeddings (rotary_percent 0.5), each equal to transformers', and a whole
NemotronForCausalLM equal to GPTModel with the same weights (fp32, CPU)."""

import os

import pytest
import torch
import torch.nn.functional as F

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.transformer.mlp import activate
from mp_layers.transformer.norms import LayerNorm1P, RMSNorm1P, build_norm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.nemotron import modeling_nemotron  # noqa: E402

BASE = dict(num_layers=1, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0)  # fmt: skip
VOCAB, SEQ = 96, 12


def test_layernorm_1p_equals_nemotron_layernorm1p():
    torch.manual_seed(0)
    hf = modeling_nemotron.NemotronLayerNorm1P(64, eps=1e-5)
    norm = build_norm(TransformerConfig(**BASE, apply_layernorm_1p=True))
    assert isinstance(norm, LayerNorm1P)
    assert norm.weight.count_nonzero() == 0 and norm.bias.count_nonzero() == 0  # 1 + 0
    with torch.no_grad():
        hf.weight.normal_(std=0.3), hf.bias.normal_(std=0.3)
        norm.weight.copy_(hf.weight), norm.bias.copy_(hf.bias)  # the same stored w
    x = torch.randn(5, 2, 64) * 3 + 1
    torch.testing.assert_close(norm(x), hf(x), rtol=1e-6, atol=1e-6)


def test_rmsnorm_1p_scales_by_one_plus_the_weight():
    norm = build_norm(TransformerConfig(**BASE, normalization="RMSNorm", apply_layernorm_1p=True))
    assert isinstance(norm, RMSNorm1P) and norm.weight.count_nonzero() == 0
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 64)
    want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), want)


def test_every_norm_follows_apply_layernorm_1p():
    config = TransformerConfig(**BASE, apply_layernorm_1p=True, qk_layernorm=True)
    model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())
    norms = {n for n, m in model.named_modules() if isinstance(m, LayerNorm1P)}
    assert norms == {
        "decoder.layers.0.input_layernorm", "decoder.layers.0.pre_mlp_layernorm",
        "decoder.layers.0.self_attention.q_layernorm",
        "decoder.layers.0.self_attention.k_layernorm", "decoder.final_layernorm",
    }  # fmt: skip


def test_squared_relu_equals_relu2():
    config = TransformerConfig(**BASE, activation="squared_relu")
    x = torch.randn(100) * 3
    torch.testing.assert_close(activate(config, x), ACT2FN["relu2"](x), rtol=0, atol=0)


def test_partial_rotary_equals_nemotrons_apply_rotary_pos_emb():
    """rotary_percent 0.5: the first half of each head's channels rotate (rotate_half
    within them), the rest pass through, as with Nemotron's partial_rotary_factor."""
    from mp_layers.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb

    hf_config = transformers.NemotronConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                            partial_rotary_factor=0.5)  # fmt: skip
    rotary = modeling_nemotron.NemotronRotaryEmbedding(hf_config)
    q, k = torch.randn(2, 4, SEQ, 16), torch.randn(2, 4, SEQ, 16)  # [b, n, s, d]
    cos, sin = rotary(q, torch.arange(SEQ)[None].expand(2, -1))
    want_q, want_k = modeling_nemotron.apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(16, rotary_percent=0.5, rotary_base=10000)(SEQ)
    for t, want in ((q, want_q), (k, want_k)):
        got = apply_rotary_pos_emb(t.permute(2, 0, 1, 3), ours).permute(1, 2, 0, 3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(want_q[..., 8:], q[..., 8:])


def logical_from_nemotron(hf, groups: int) -> dict[str, torch.Tensor]:
    sd = hf.state_dict()
    heads, d = hf.config.num_attention_heads, hf.config.head_dim
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "output_layer.weight": sd["lm_head.weight"]}  # fmt: skip
    for part in ("weight", "bias"):
        out[f"decoder.final_layernorm.{part}"] = sd[f"model.norm.{part}"]
    for i in range(hf.config.num_hidden_layers):
        hf_l, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = ours + "self_attention."
        out[attn + "linear_qkv.q.weight"] = sd[hf_l + "self_attn.q_proj.weight"].reshape(
            groups, heads // groups, d, -1
        )
        out[attn + "linear_qkv.k.weight"] = sd[hf_l + "self_attn.k_proj.weight"].reshape(
            groups, d, -1
        )
        out[attn + "linear_qkv.v.weight"] = sd[hf_l + "self_attn.v_proj.weight"].reshape(
            groups, d, -1
        )
        out[attn + "linear_proj.weight"] = sd[hf_l + "self_attn.o_proj.weight"]
        out[ours + "mlp.linear_fc1.weight"] = sd[hf_l + "mlp.up_proj.weight"]
        out[ours + "mlp.linear_fc2.weight"] = sd[hf_l + "mlp.down_proj.weight"]
        for part in ("weight", "bias"):
            out[f"{ours}input_layernorm.{part}"] = sd[f"{hf_l}input_layernorm.{part}"]
            out[f"{ours}pre_mlp_layernorm.{part}"] = sd[f"{hf_l}post_attention_layernorm.{part}"]
    return out


def test_gpt_model_equals_nemotron_for_causal_lm():
    torch.manual_seed(0)
    hf = modeling_nemotron.NemotronForCausalLM(transformers.NemotronConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        max_position_embeddings=SEQ, norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
    )).eval()  # fmt: skip
    with torch.no_grad():  # norms away from their init, so that 1 + w is tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(std=0.2)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, normalization="LayerNorm", apply_layernorm_1p=True,
        activation="squared_relu", position_embedding_type="rope", rotary_percent=0.5,
        rotary_base=10000, add_bias_linear=False, untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    ours = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).eval()
    tensors = logical_from_nemotron(hf, groups=2)
    pieces = ours.sharded_state_dict()
    assert pieces.keys() == tensors.keys(), pieces.keys() ^ tensors.keys()
    with torch.no_grad():
        for key, piece in pieces.items():
            piece.data.copy_(tensors[key].reshape(piece.global_shape)[piece.global_slices])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layernorm_1p_leaves_the_plain_norms_alone():
    norm = build_norm(TransformerConfig(**BASE))
    assert type(norm) is torch.nn.LayerNorm and norm.weight.eq(1).all()
    x = torch.randn(2, 64)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (64,)))
