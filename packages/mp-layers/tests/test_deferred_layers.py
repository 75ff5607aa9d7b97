"""Whole models built with deferred weights (on_layer_built(..., defer_weights=True), as
ZeRO-3 with --init-model-with-meta-device builds them): on one pipeline stage every weight
matrix larger than [1, h] (in the transformer layers, the MTP modules, the embedding and
the output layer) is left on the meta device with a recipe, and filling it from the
recipe gives the weights of the model built whole with the same seed, bitwise; the other
parameters are built as before, and the default generator ends where the whole build
leaves it. Configs: dense (GQA, SwiGLU, tied embeddings), MLA with MoE (sigmoid router
with expert bias, a gated shared expert) and two MTP modules in bf16, and gpt-oss's
layer (learnable sinks, biases everywhere, the router's bias, the experts' quick GEGLU)."""

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.transformer.layer_hooks import on_layer_built

VOCAB, SEQ = 96, 16
BASE = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
    normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
    position_embedding_type="rope", untie_embeddings_and_output_weights=True,
    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
)  # fmt: skip
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, moe_aux_loss_coeff=0.0)
CONFIGS = {
    "dense-gqa": dict(num_query_groups=2, untie_embeddings_and_output_weights=False),
    "mla-moe-mtp-bf16": dict(
        MOE, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
        qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, rope_type="rope",
        moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=True, mtp_num_layers=2, params_dtype=torch.bfloat16,
    ),
    "gpt-oss": dict(
        MOE, activation="gelu", quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=7.0, add_bias_linear=True, softmax_type="learnable",
    ),
}  # fmt: skip


def build(config: TransformerConfig, defer: bool):
    torch.manual_seed(11)
    layers = []
    with on_layer_built(layers.append, defer_weights=defer):
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())
    return model, layers, torch.get_rng_state()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deferred_layers_fill_to_the_whole_build(name):
    config = TransformerConfig(**(BASE | CONFIGS[name]))
    whole, _, after = build(config, defer=False)
    later, layers, after_later = build(config, defer=True)
    assert torch.equal(after_later, after)
    expected = config.num_layers + (config.mtp_num_layers or 0)
    assert len(layers) == expected
    built = dict(whole.named_parameters())
    deferred = 0
    for key, param in later.named_parameters():
        big = key.endswith("weight") and param.dim() >= 2 and param.numel() > config.hidden_size
        if big:
            assert param.is_meta and hasattr(param, "_mp_deferred_init"), key
        if not param.is_meta:
            assert torch.equal(param, built[key]), key
            continue
        deferred += 1
        out = torch.full(param.shape, float("nan"))
        rows = param.shape[0]
        half = rows // 2
        recipe = param._mp_deferred_init
        recipe.fill_rows(0, half, out[:half], param.dtype)  # two shards, as FSDP's
        recipe.fill_rows(half, rows, out[half:], param.dtype)
        assert torch.equal(out.to(param.dtype), built[key]), key
    assert deferred >= 4 * expected, deferred
