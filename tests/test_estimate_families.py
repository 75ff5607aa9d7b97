"""`mp-train estimate` counts exactly the parameters GPTModel holds, for every family
mp-ckpt converts: the settings of a small transformers config of each model_type (as
import-hf reads them) become the run's TransformerConfig."""

import dataclasses

import pytest
import torch

from mp_ckpt import model_config_from_hf
from mp_data import DataConfig
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import OptimizerConfig
from mp_state import ParallelConfig, RankGroup
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64, intermediate_size=96)  # fmt: skip
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK = dict(SMALL, num_attention_heads=4, num_key_value_heads=4, **MOE, n_routed_experts=4,
                first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip
GRANITE = dict(embedding_multiplier=12.0, attention_multiplier=0.0078125,
               residual_multiplier=0.22, logits_scaling=8.0)  # fmt: skip
FAMILIES = {
    "gpt2": dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64),
    "llama": dict(SMALL, tie_word_embeddings=True),
    "mistral": dict(SMALL, sliding_window=16),
    "qwen2": SMALL,
    "qwen3": dict(SMALL, head_dim=16),
    "nemotron": dict(SMALL, head_dim=8),
    "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(SMALL, **MOE, num_experts=4, shared_expert_intermediate_size=48,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(SMALL, **MOE, num_experts=4, head_dim=16, decoder_sparse_step=2),
    "gpt_oss": dict(SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    sliding_window=8),
    "deepseek_v3": dict(DEEPSEEK, q_lora_rank=32, n_group=2, topk_group=1),
    "deepseek_v2": dict(DEEPSEEK, q_lora_rank=None),
    "deepseek_v32": dict(DEEPSEEK, q_lora_rank=32, n_group=2, topk_group=1, index_n_heads=4,
                         index_head_dim=16, index_topk=8),
    "glm_moe_dsa": dict(DEEPSEEK, q_lora_rank=32, index_n_heads=4, index_head_dim=16,
                        index_topk=8, rms_norm_eps=1e-6),
    "olmo2": SMALL,
    "olmoe": dict(SMALL, num_experts=4, num_experts_per_tok=2),
    "olmo3": dict(SMALL, sliding_window=8),
    "glm4": dict(SMALL, head_dim=16),
    "granite": dict(SMALL, **GRANITE),
    "granitemoe": dict(SMALL, **GRANITE, num_local_experts=4, num_experts_per_tok=2),
    "granitemoeshared": dict(SMALL, **GRANITE, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48),
    "granitemoehybrid": dict(SMALL, **GRANITE, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48, mamba_n_heads=8, mamba_n_groups=2,
                             mamba_d_state=16, layer_types=["mamba", "attention", "mamba"]),
    "bamba": dict(SMALL, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                  attn_layer_indices=[1]),
    "gemma": dict(SMALL, head_dim=16, num_key_value_heads=1),
    "ministral3": dict(SMALL, head_dim=16),
    "qwen3_5_text": dict(SMALL, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
                         linear_value_head_dim=12, linear_num_key_heads=2,
                         linear_num_value_heads=4),
    "qwen3_5_moe_text": dict(SMALL, **MOE, num_hidden_layers=4, num_experts=4, head_dim=16,
                             shared_expert_intermediate_size=48, linear_key_head_dim=8,
                             linear_value_head_dim=12, linear_num_key_heads=2,
                             linear_num_value_heads=4),
    "flex_olmo": dict(SMALL, num_experts=4, num_experts_per_tok=2),
    "arcee": dict(SMALL, head_dim=16),
    "exaone4": dict(SMALL, num_hidden_layers=4, sliding_window=8),
    "minimax_m2": dict(SMALL, head_dim=16, rotary_dim=8, num_local_experts=4,
                       num_experts_per_tok=2),
    "gemma3_text": dict(SMALL, head_dim=16, sliding_window=8),
    "llama4_text": dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                        intermediate_size_mlp=80, interleave_moe_layer_step=2,
                        no_rope_layer_interval=3),
    "nemotron_h": dict(SMALL, num_hidden_layers=4, head_dim=8, mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                       layers_block_type=["mamba", "mlp", "attention", "moe"],
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=48),
    "qwen3_next": dict(SMALL, **MOE, num_hidden_layers=4, num_experts=4, head_dim=16,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1],
                       linear_key_head_dim=8, linear_value_head_dim=12,
                       linear_num_key_heads=2, linear_num_value_heads=4),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_estimate_counts_the_models_parameters(family):
    settings = model_config_from_hf(transformers.AutoConfig.for_model(
        family, **FAMILIES[family]).to_dict())  # fmt: skip
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kept = {k: v for k, v in settings.items() if k in fields}
    model = TransformerConfig(**kept | {"hidden_dropout": 0.0, "attention_dropout": 0.0})
    vocab, positions = settings["vocab_size"], settings["max_position_embeddings"]
    run = RunConfig(model=model, parallel=ParallelConfig(),
                    gpt=GPTConfig(seq_length=32, max_position_embeddings=positions),
                    optimizer=OptimizerConfig(), data=DataConfig(vocab_size=vocab),
                    training=TrainingConfig(micro_batch_size=1))  # fmt: skip
    result = estimate(run, world_size=1, vocab_size=vocab)
    gpt = GPTModel(model, "local", result["padded_vocab_size"], positions,
                   groups=ModelGroups.single())  # fmt: skip
    assert sum(p.numel() for p in gpt.parameters()) == result["num_parameters"]


def counted_on_one_rank(model: TransformerConfig, vocab: int = 100) -> RunConfig:
    """The run of `model` (sequences of 32) on one rank, once its estimate is checked to
    count exactly the parameters GPTModel holds."""
    run = RunConfig(model=model, parallel=ParallelConfig(), gpt=GPTConfig(seq_length=32),
                    optimizer=OptimizerConfig(), data=DataConfig(vocab_size=vocab),
                    training=TrainingConfig(micro_batch_size=1))  # fmt: skip
    result = estimate(run, world_size=1, vocab_size=vocab)
    gpt = GPTModel(model, "local", result["padded_vocab_size"], 32, groups=ModelGroups.single())
    assert sum(p.numel() for p in gpt.parameters()) == result["num_parameters"]
    return run


MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, multi_latent_attention=True,
           kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [dict(q_lora_rank=48, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
          num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1]),
     dict(qk_layernorm=True, add_bias_linear=True), dict(q_lora_rank=48),
     dict(q_lora_rank=48, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
          num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1], mtp_num_layers=2,
          untie_embeddings_and_output_weights=True),
     dict(q_lora_rank=48, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
          experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
          dsa_indexer_topk=8),
     dict(add_bias_linear=False, experimental_attention_variant="dsa", dsa_indexer_n_heads=2,
          dsa_indexer_head_dim=8, dsa_indexer_topk=8),
     dict(num_layers=5, q_lora_rank=48, add_bias_linear=False,
          experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
          dsa_indexer_topk=8, dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)],
    ids=["deepseek-v3", "v2-lite-layernorm-bias", "no-latent-norms", "deepseek-v3-mtp2",
         "deepseek-v3.2", "sparse-without-query-latent", "sparse-shared-choice"],
)  # fmt: skip
def test_estimate_counts_multi_latent_attention(changes):
    """DeepSeek's attention in Megatron's variants besides the Hugging Face families': a
    query latent or none, latent norms (LayerNorm's biases included) or none, the output
    projection's bias, the sparse-attention indexer."""
    counted_on_one_rank(TransformerConfig(**MLA | changes))


def _rank(kind: str, size: int) -> RankGroup:
    """Rank 0 of a group of `size` ranks, as a layer's constructor sees it (no process
    group: constructing a layer takes its slice of each weight without communicating)."""
    return RankGroup(kind, tuple(range(size)), 0, None)


LAYOUT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0)  # fmt: skip
MOE_TP = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0],
              sequence_parallel=True)  # fmt: skip
HYBRID = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2,
              mamba_num_heads=8, mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=16,
              normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
              hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
HYBRID_MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
HYBRIDS = {
    "dense": dict(hybrid_layer_pattern="M-M*-"),
    "moe-shared-expert": dict(hybrid_layer_pattern="M*EM-E", **HYBRID_MOE,
                              moe_shared_expert_intermediate_size=48,
                              moe_shared_expert_gate=True, activation="swiglu"),
    "biases-layernorm": dict(hybrid_layer_pattern="M*-M", add_bias_linear=True,
                             normalization="LayerNorm", untie_embeddings_and_output_weights=True),
    "default-inner-width": dict(hybrid_layer_pattern="MM*E", **HYBRID_MOE,
                                mamba_num_heads=None, add_bias_linear=True),
    # Nemotron 3 Super's latent MoE: the experts at width 24, with and without biases
    "latent-moe": dict(hybrid_layer_pattern="M*E-E", **HYBRID_MOE, moe_latent_size=24,
                       moe_shared_expert_intermediate_size=48),
    "latent-moe-biases": dict(hybrid_layer_pattern="ME*", **HYBRID_MOE, moe_latent_size=24,
                              add_bias_linear=True),
    # gated DeltaNet (G) layers beside Mamba, attention and MoE ones (Megatron's HybridModel)
    "gated-delta-net": dict(hybrid_layer_pattern="MG*GE", **HYBRID_MOE, activation="swiglu",
                            linear_key_head_dim=8,
                            linear_value_head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4),
}  # fmt: skip
"""Mamba-hybrid models (Nemotron-H's layout) in the estimate's variants."""


def hybrid(name: str, **more) -> dict:
    fields = HYBRID | HYBRIDS[name] | more
    return fields | {"num_layers": len(fields["hybrid_layer_pattern"])}


@pytest.mark.parametrize(
    ("fields", "etp"),
    [(dict(LAYOUT, num_query_groups=2, kv_channels=16, qk_layernorm=True, activation="swiglu",
           softmax_type="learnable", **MOE_TP), 1),
     (dict(LAYOUT, add_bias_linear=False, moe_shared_expert_intermediate_size=32,
           moe_shared_expert_gate=True, **MOE_TP), 2),
     (dict(MLA, q_lora_rank=48, qk_layernorm=True, add_bias_linear=True), None),
     (dict(LAYOUT, untie_embeddings_and_output_weights=True), None),
     (dict(MLA, q_lora_rank=48, mtp_num_layers=1, **MOE_TP), None),
     (dict(MLA, q_lora_rank=48, add_bias_linear=False, experimental_attention_variant="dsa",
           dsa_indexer_n_heads=4, dsa_indexer_head_dim=16, dsa_indexer_topk=8,
           dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1), None),
     *((hybrid(name, sequence_parallel=True),
        1 if "E" in hybrid(name)["hybrid_layer_pattern"] else None) for name in HYBRIDS),
     (dict(LAYOUT, num_layers=3, num_query_groups=2, kv_channels=16, activation="swiglu",
           normalization="RMSNorm", add_bias_linear=False, attention_output_gate=True,
           experimental_attention_variant="gdn", linear_attention_freq=[1, 0, 1],
           linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
           linear_num_value_heads=4, mtp_num_layers=1, position_embedding_type="rope"),
      None),
     (dict(LAYOUT, num_query_groups=2, kv_channels=16, normalization="RMSNorm",
           qk_layernorm=True, qk_layernorm_scope="all_heads", sublayer_norm="both"), None)],
    ids=["gqa-biases-sinks-moe", "shared-expert-gate-expert-tp2", "mla", "gpt2-untied",
         "mla-moe-mtp", "mla-sparse", *(f"hybrid-{name}" for name in HYBRIDS),
         "gated-delta-net-mtp", "sandwich-all-heads-qk-norm"],
)  # fmt: skip
def test_estimate_holds_what_a_tensor_parallel_rank_allocates(fields, etp):
    """At TP 2 (EP 2 with experts) one rank's parameters are GPTModel's on rank 0: the
    pieces split over the ranks, the norms, row-parallel biases, routers, MLA's down
    projections and sparse-attention indexer and learned positions whole, the experts over
    EP x expert-TP; in hybrid models the Mamba mixers by whole groups of heads, their
    layer's norm and out_proj's bias whole; gated DeltaNets by whole key heads, their
    output norm whole."""
    model = TransformerConfig(**fields)
    ep = 2 if model.num_moe_experts else 1
    parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=ep,
                              expert_tensor_parallel_size=etp)  # fmt: skip
    run = RunConfig(model=model, parallel=parallel, gpt=GPTConfig(seq_length=32),
                    optimizer=OptimizerConfig(), data=DataConfig(vocab_size=100),
                    training=TrainingConfig(micro_batch_size=1))  # fmt: skip
    result = estimate(run, world_size=2 * ep)
    groups = dataclasses.replace(
        ModelGroups.single(), tp=_rank("tp", 2), ep=_rank("ep", ep),
        expert_tp=_rank("expert_tp", parallel.expert_tensor_parallel_size if ep > 1 else 1),
    )  # fmt: skip
    gpt = GPTModel(model, "local", result["padded_vocab_size"], 32, groups=groups)
    held = {name: p.numel() for name, p in gpt.named_parameters()}
    experts = sum(n for name, n in held.items() if ".experts." in name)
    assert sum(held.values()) - experts == result["parameters_on_most_loaded_shard"]
    assert experts == result["expert_parameters_on_most_loaded_shard"]


def test_the_l2_qk_norm_holds_no_weights_over_qk_layernorm():
    """Megatron's Llama 4 Scout line gives --qk-layernorm and --export-qk-l2-norm: the L2
    norm replaces the layernorm, so there are no QK norm weights to count."""
    model = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                              position_embedding_type="rope", qk_layernorm=True,
                              qk_l2_norm=True, attention_dropout=0.0)  # fmt: skip
    counted_on_one_rank(model, vocab=128)


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_estimate_counts_a_hybrid_models_parameters(name):
    """Mamba-hybrid models: each layer one sublayer and its norm, a Mamba mixer's in_proj,
    conv1d, dt_bias, A_log, D, gated norm and out_proj; without mamba_num_heads the inner
    width is 2h. (At TP 2 the mixers split by whole groups of heads:
    test_estimate_holds_what_a_tensor_parallel_rank_allocates.)"""
    counted_on_one_rank(TransformerConfig(**hybrid(name)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_delta_net_activations_are_the_tensors_it_keeps(dtype):
    """mp_train.estimate.linear_attention's count of a gated DeltaNet's activations (less its
    layer's input norm's input, which the layer keeps) against the bytes of the tensors the
    module saves for backward in training (its parameters left out), within 2% (the
    convolution's K - 1 positions of history per sample)."""
    from mp_layers.transformer.gated_delta_net import GatedDeltaNet
    from mp_layers.transformer.spec import LOCAL_SPEC
    from mp_train.estimate.linear_attention import gdn_activation

    s, b, h = 256, 2, 128
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=4, normalization="RMSNorm",
        activation="swiglu", add_bias_linear=False, params_dtype=dtype,
        experimental_attention_variant="gdn",
        linear_attention_freq=[1], linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=4, linear_num_value_heads=8,
    )  # fmt: skip
    layer = GatedDeltaNet(config, ModelGroups.single(), spec=LOCAL_SPEC).train()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    whole, split, fp32 = gdn_activation(config, s, b)
    width = 2 if dtype == torch.float32 else 1  # the 16-bit counts in this precision
    counted = (whole / 2 + split) * width + fp32
    assert abs(sum(kept.values()) / counted - 1) < 0.02, (sum(kept.values()), counted)
