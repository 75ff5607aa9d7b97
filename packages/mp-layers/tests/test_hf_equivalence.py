"""With the same weights, GPTModel equals transformers' GPT2LMHeadModel and LlamaForCausalLM.

Models are built from configs (no downloads). Hugging Face weights are mapped
to our logical names by mp_ckpt.logical_from_hf and loaded through the
model's own sharding description: every piece is a view of a parameter, so
loading a logical tensor is copying its slice into the piece.
"""

import os

import pytest
import torch

from mp_ckpt import logical_from_hf
from mp_layers import GPTModel, ModelGroups, TransformerConfig
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


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attention_backend", ["flash", "local"])
def test_gpt2_style_equals_gpt2lmheadmodel(attention_backend):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )).eval()  # fmt: skip
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               attention_backend=attention_backend)  # fmt: skip
    ours = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).eval()
    load_logical(ours, logical_from_hf(hf.state_dict(), hf.config.to_dict()))
    with torch.no_grad():
        want, got = hf(ids()).logits, ours(ids())
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("attention_backend", ["flash", "local"])
def test_llama_style_equals_llamaforcausallm(attention_backend):
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
        hidden_dropout=0.0, attention_dropout=0.0, attention_backend=attention_backend,
    )  # fmt: skip
    ours = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).eval()
    load_logical(ours, logical_from_hf(hf.state_dict(), hf.config.to_dict()))
    with torch.no_grad():
        want, got = hf(ids()).logits, ours(ids())
    assert (got - want).abs().max() < 1e-4
