"""Multi-latent attention equals transformers' DeepseekV3Attention (query latent) and
DeepseekV2Attention (no query latent, DeepSeek-V2-Lite) in fp32 with the same weights,
YaRN's frequencies, its cos/sin factor and the softmax scale's mscale included, through
the blocked attention and SDPA; and its configuration is checked field by field."""

import os

import pytest
import torch

from mp_layers import LOCAL_SPEC, ModelGroups, TransformerConfig
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_layers.transformer.rope import RotaryEmbedding, yarn_scaling

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V, SEQ, EPS = 32, 4, 16, 12, 8, 4, 6, 24, 1e-6
# YaRN with a context extended 4 times from 16 positions, so that the ramp, the cos/sin
# factor mscale / mscale_all_dim and the softmax scale's mscale_all_dim^2 all differ from 1.
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.9)  # fmt: skip


def hf_attention(version: str):
    torch.manual_seed(0)
    module = modeling_deepseek_v3 if version == "v3" else modeling_deepseek_v2
    config_class = getattr(transformers, f"Deepseek{version.upper()}Config")
    config = config_class(
        vocab_size=32, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=Q_LORA if version == "v3" else None, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        max_position_embeddings=64, attention_dropout=0.0, rope_parameters=YARN,
    )  # fmt: skip
    config._attn_implementation = "eager"
    cls = module.DeepseekV3Attention if version == "v3" else module.DeepseekV2Attention
    rotary = (module.DeepseekV3RotaryEmbedding if version == "v3"
              else module.DeepseekV2RotaryEmbedding)(config)  # fmt: skip
    attention = cls(config, layer_idx=0).eval()
    with torch.no_grad():  # the latent norms start at 1: make them count
        for norm in (attention.q_a_layernorm, attention.kv_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return attention, rotary


def mp_config(version: str, **changes) -> TransformerConfig:
    settings = dict(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, multi_latent_attention=True,
        q_lora_rank=Q_LORA if version == "v3" else None, kv_lora_rank=KV_LORA,
        qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V, qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=10000, yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=16, yarn_mscale=0.707, yarn_mscale_all_dim=0.9,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return TransformerConfig(**(settings | changes))


# Hugging Face's module -> ours (the names later conversions will map).
NAMES = {
    "q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
    "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj",
}  # fmt: skip


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_mla_equals_deepseek_attention(version):
    hf, hf_rotary = hf_attention(version)
    x = torch.randn(2, SEQ, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ)[None].expand(2, SEQ)
    mask = torch.full((SEQ, SEQ), -torch.inf).triu(1)[None, None]
    with torch.no_grad():
        if version == "v3":
            want = hf(x, hf_rotary(x, positions), mask)[0]
        else:
            want = hf(x, mask, position_embeddings=hf_rotary(x, positions))[0]
    for backend in ("local", "flash"):
        config = mp_config(version, attention_backend=backend)
        ours = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).eval()
        copied = set()
        with torch.no_grad():
            for theirs_name, ours_name in NAMES.items():
                theirs = getattr(hf, theirs_name)
                if theirs is not None:
                    getattr(ours, ours_name).weight.copy_(theirs.weight)
                    copied.add(ours_name)
        assert {n for n, _ in ours.named_parameters()} == {f"{n}.weight" for n in copied}
        rotary = RotaryEmbedding(ROPE, 1.0, 10000, yarn=yarn_scaling(config))(SEQ)
        assert rotary.cos.abs().max() != pytest.approx(1.0)  # YaRN's cos/sin factor
        with torch.no_grad():
            out, bias = ours(x.transpose(0, 1), rotary)
        assert bias is None
        torch.testing.assert_close(out.transpose(0, 1), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, b=backend: f"{version} {b}: {m}")  # fmt: skip


STANDARD = dict(multi_latent_attention=False, position_embedding_type="rope")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(STANDARD, kv_lora_rank=64), r"kv_lora_rank=64 needs multi_latent_attention"),
        (dict(STANDARD, rope_type="yarn"), r"rope_type='yarn' applies to multi-latent attention"),
        (dict(num_query_groups=2), r"num_query_groups=2 with multi_latent_attention"),
        (dict(qk_pos_emb_head_dim=5), r"qk_pos_emb_head_dim=5 must be even"),
        (dict(q_lora_rank=0), r"q_lora_rank=0 must be a positive integer"),
        (dict(window_size=(4, 0)), r"window_size=\(4, 0\) is not implemented with multi_latent"),
        (dict(rope_type="rope"), r"yarn_rotary_scaling_factor=4.0 needs position_embedding_type"),
    ],
)  # fmt: skip
def test_mla_configuration_is_checked(changes, message):
    with pytest.raises(ValueError, match=message):
        if changes.get("multi_latent_attention", True):
            mp_config("v3", **changes)
        else:
            TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, **changes)


def test_mla_heads_divide_over_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=8 does not divide "
                       "num_attention_heads=4"):  # fmt: skip
        mp_config("v3").check_parallel(8)
