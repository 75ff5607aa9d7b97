"""gpt-oss's attention in mp: YaRN frequencies, cos and sin equal transformers'
(_compute_yarn_parameters, GptOssRotaryEmbedding), and each layer's attention sub-block
(sinks, a sliding window on every other layer, biases, grouped-query attention) equals
GptOssAttention's output with the same weights, on the banded and the blocked path.

Models are built from configs (no downloads); the MoE MLP of gpt-oss is not compared here.
"""

import os

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.transformer.rope import RotaryEmbedding, YarnScaling

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                    beta_slow=1.0, original_max_position_embeddings=4096)  # fmt: skip


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_yarn_equals_transformers_for_gpt_oss(truncate, head_dim):
    """gpt-oss-20b's rope settings (truncate False), and the rounding Megatron defaults to."""
    hf_config = transformers.GptOssConfig(
        head_dim=head_dim, rope_parameters=GPT_OSS_ROPE | {"truncate": truncate}
    )
    inv_freq, attention_factor = _compute_yarn_parameters(hf_config)
    rope = RotaryEmbedding(
        head_dim, 1.0, 150000, yarn=YarnScaling(32.0, 4096, 32.0, 1.0, round_to_int=truncate)
    )
    torch.testing.assert_close(rope.inv_freq, inv_freq, rtol=0, atol=1e-6)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    hf_rope = modeling_gpt_oss.GptOssRotaryEmbedding(hf_config)
    positions = torch.tensor([[0, 1, 7, 100, 4095, 4096, 70000]])
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions)  # [1, s, d/2]
    ours = rope.at(positions.t())  # [s, 1, 1, d]: the halves repeated
    torch.testing.assert_close(ours.cos[:, 0, 0, : head_dim // 2], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[:, 0, 0, : head_dim // 2], sin[0], rtol=0, atol=1e-6)


H, HEADS, GROUPS, D, WINDOW, SEQ = 64, 8, 4, 8, 4, 12


def hf_model():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=32, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=D,
        sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=256, attention_dropout=0.0,
        rope_parameters=GPT_OSS_ROPE | {"truncate": False, "original_max_position_embeddings": 8},
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)  # empty until from_pretrained
    return model


def mp_model(backend: str) -> GPTModel:
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=D, normalization="RMSNorm", add_bias_linear=True,
        softmax_type="learnable", window_size=(WINDOW - 1, 0), window_attn_skip_freq=2,
        position_embedding_type="yarn", rotary_base=150000, yarn_rotary_scaling_factor=32.0,
        yarn_original_max_position_embeddings=8, yarn_correction_range_round_to_int=False,
        hidden_dropout=0.0, attention_dropout=0.0, attention_backend=backend,
    )  # fmt: skip
    return GPTModel(config, "local", 32, SEQ, groups=ModelGroups.single()).eval()


def copy_attention(ours, theirs) -> None:
    """HF's q/k/v/o projections and sinks into mp's fused per-group QKV layout."""
    per_group = HEADS // GROUPS
    with torch.no_grad():
        for name in ("weight", "bias"):
            fused = getattr(ours.linear_qkv, name).view(GROUPS, per_group + 2, D, -1)
            fused[:, :per_group] = getattr(theirs.q_proj, name).view(GROUPS, per_group, D, -1)
            fused[:, per_group] = getattr(theirs.k_proj, name).view(GROUPS, D, -1)
            fused[:, per_group + 1] = getattr(theirs.v_proj, name).view(GROUPS, D, -1)
        ours.linear_proj.weight.copy_(theirs.o_proj.weight)
        ours.linear_proj.bias.copy_(theirs.o_proj.bias)
        ours.core_attention.softmax_offset.copy_(theirs.sinks)


@pytest.mark.parametrize("backend", ["flash", "local"])
def test_each_layers_attention_equals_gpt_oss_attention(backend):
    hf = hf_model()
    seen = {}

    def keep(i):
        def hook(module, args, kwargs, output):
            seen[i] = (kwargs["hidden_states"], output[0])

        return hook

    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.register_forward_hook(keep(i), with_kwargs=True)
    ids = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf(ids)
    ours = mp_model(backend)
    assert [layer.self_attention.window for layer in ours.decoder.layers] == [WINDOW - 1, None]
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    rotary = ours.rotary(SEQ)
    for i, layer in enumerate(ours.decoder.layers):
        copy_attention(layer.self_attention, hf.model.layers[i].self_attn)
        x, want = seen[i]
        with torch.no_grad():
            out, bias = layer.self_attention(x.transpose(0, 1), rotary)
        got = (out + bias).transpose(0, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {i}")
    assert SEQ > WINDOW  # the window masked something on layer 0
