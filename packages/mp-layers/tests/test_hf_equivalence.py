"""With the same weights, GPTModel equals transformers' GPT2LMHeadModel and LlamaForCausalLM.

Models are built from configs (no downloads). Hugging Face weights are mapped
to our logical names here and loaded through the model's own sharding
description: every piece is a view of a parameter, so loading a logical
tensor is copying its slice into the piece.
"""

import os

import pytest
import torch

from mp_layers import GPTModel, TransformerConfig
from mp_state import RankGroup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

ONE_RANK = RankGroup("tp", (0,), 0, None)
VOCAB, SEQ = 96, 24


def load_logical(model: GPTModel, tensors: dict[str, torch.Tensor]) -> None:
    pieces = model.sharded_state_dict()
    assert pieces.keys() == tensors.keys(), pieces.keys() ^ tensors.keys()
    with torch.no_grad():
        for key, piece in pieces.items():
            piece.data.copy_(tensors[key].reshape(piece.global_shape)[piece.global_slices])


def gpt2_logical(hf, layers: int, heads: int) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D weights are [in, out]: transpose to [out, in]."""
    sd = hf.state_dict()
    h = sd["transformer.wte.weight"].shape[1]
    d = h // heads
    out = {
        "embedding.word_embeddings.weight": sd["transformer.wte.weight"],
        "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        qkv_w = sd[src + "attn.c_attn.weight"].t()  # [3h, h]: q, k, v blocks
        qkv_b = sd[src + "attn.c_attn.bias"]
        for part, w, b in zip("qkv", qkv_w.chunk(3), qkv_b.chunk(3), strict=True):
            # MHA: one query head per group.
            shape = (heads, 1, d) if part == "q" else (heads, d)
            out[f"{dst}self_attention.linear_qkv.{part}.weight"] = w.reshape(*shape, h)
            out[f"{dst}self_attention.linear_qkv.{part}.bias"] = b.reshape(shape)
        out |= {
            dst + "self_attention.linear_proj.weight": sd[src + "attn.c_proj.weight"].t(),
            dst + "self_attention.linear_proj.bias": sd[src + "attn.c_proj.bias"],
            dst + "mlp.linear_fc1.weight": sd[src + "mlp.c_fc.weight"].t(),
            dst + "mlp.linear_fc1.bias": sd[src + "mlp.c_fc.bias"],
            dst + "mlp.linear_fc2.weight": sd[src + "mlp.c_proj.weight"].t(),
            dst + "mlp.linear_fc2.bias": sd[src + "mlp.c_proj.bias"],
            dst + "input_layernorm.weight": sd[src + "ln_1.weight"],
            dst + "input_layernorm.bias": sd[src + "ln_1.bias"],
            dst + "pre_mlp_layernorm.weight": sd[src + "ln_2.weight"],
            dst + "pre_mlp_layernorm.bias": sd[src + "ln_2.bias"],
        }
    return out


def llama_logical(hf, layers: int, heads: int, groups: int) -> dict[str, torch.Tensor]:
    """Query head j attends with key/value head j // (heads / groups), as our groups do."""
    sd = hf.state_dict()
    h = sd["model.embed_tokens.weight"].shape[1]
    d = sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // groups
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out |= {
            dst + "self_attention.linear_qkv.q.weight":
                sd[src + "self_attn.q_proj.weight"].reshape(groups, heads // groups, d, h),
            dst + "self_attention.linear_qkv.k.weight":
                sd[src + "self_attn.k_proj.weight"].reshape(groups, d, h),
            dst + "self_attention.linear_qkv.v.weight":
                sd[src + "self_attn.v_proj.weight"].reshape(groups, d, h),
            dst + "self_attention.linear_proj.weight": sd[src + "self_attn.o_proj.weight"],
            dst + "mlp.linear_fc1.gate.weight": sd[src + "mlp.gate_proj.weight"],
            dst + "mlp.linear_fc1.up.weight": sd[src + "mlp.up_proj.weight"],
            dst + "mlp.linear_fc2.weight": sd[src + "mlp.down_proj.weight"],
            dst + "input_layernorm.weight": sd[src + "input_layernorm.weight"],
            dst + "pre_mlp_layernorm.weight": sd[src + "post_attention_layernorm.weight"],
        }  # fmt: skip
    return out


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_gpt2_style_equals_gpt2lmheadmodel():
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )).eval()  # fmt: skip
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    ours = GPTModel(config, "local", VOCAB, SEQ, tp_group=ONE_RANK).eval()
    load_logical(ours, gpt2_logical(hf, 2, 4))
    with torch.no_grad():
        want, got = hf(ids()).logits, ours(ids())
    assert (got - want).abs().max() < 1e-4


def test_llama_style_equals_llamaforcausallm():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=SEQ, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )).eval()  # fmt: skip
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
        kv_channels=8, ffn_hidden_size=96, normalization="RMSNorm", layernorm_epsilon=1e-6,
        activation="swiglu", position_embedding_type="rope", rotary_base=10000,
        add_bias_linear=False, untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    ours = GPTModel(config, "local", VOCAB, SEQ, tp_group=ONE_RANK).eval()
    load_logical(ours, llama_logical(hf, 2, 8, 4))
    with torch.no_grad():
        want, got = hf(ids()).logits, ours(ids())
    assert (got - want).abs().max() < 1e-4
