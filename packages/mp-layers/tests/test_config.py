"""TransformerConfig: defaults and every validation rule."""

import warnings

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig

BASE = dict(num_layers=4, hidden_size=256, num_attention_heads=8)


def test_defaults_follow_megatron():
    c = TransformerConfig(**BASE)
    assert (c.ffn_hidden_size, c.num_query_groups, c.kv_channels) == (1024, 8, 32)
    assert c.params_dtype == torch.float32 and c.normalization == "LayerNorm"
    assert c.output_layer_init_std == pytest.approx(0.02 / 8**0.5)
    swiglu = TransformerConfig(**BASE, activation="swiglu")
    assert swiglu.ffn_hidden_size == int(4 * 256 * 2 / 3 / 64) * 64 == 640
    gqa = TransformerConfig(**BASE, num_query_groups=2, kv_channels=64)
    assert (gqa.num_query_groups, gqa.kv_channels) == (2, 64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_layers=0), "num_layers=0 must be a positive integer"),
        (dict(hidden_size=250), "num_attention_heads=8 does not divide hidden_size=250"),
        (dict(num_query_groups=3), "num_query_groups=3 does not divide num_attention_heads=8"),
        (dict(normalization="BatchNorm"), "normalization='BatchNorm' must be one of"),
        (dict(activation="relu"),
         "activation='relu' must be one of gelu, swiglu, geglu, squared_relu"),
        (dict(attention_backend="sdpa"), "attention_backend='sdpa' must be one of auto, flash"),
        (dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
        (dict(layernorm_epsilon=0.0), "layernorm_epsilon=0.0 must be > 0"),
        (dict(hidden_dropout=1.0), r"hidden_dropout=1.0 must be in \[0, 1\)"),
        (dict(attention_dropout=-0.1), "attention_dropout=-0.1"),
        (dict(rotary_percent=0.0), r"rotary_percent=0.0 must be in \(0, 1\]"),
        (dict(rotary_base=0), "rotary_base=0 must be > 0"),
        (dict(rotary_seq_len_interpolation_factor=0.5), "rotary_seq_len_interpolation_factor"),
        (dict(init_method_std=0.0), "init_method_std=0.0 must be > 0"),
        (dict(output_loss_chunk_tokens=-1), "output_loss_chunk_tokens=-1 must be an integer >= 0"),
        (dict(activation="swiglu", openai_gelu=True), "openai_gelu=True applies to activation"),
        (dict(use_rope_scaling=True), "use_rope_scaling=True needs position_embedding_type"),
        (dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=0.5),
         "rope_scaling_factor=0.5 must be >= 1"),
        (dict(position_embedding_type="rope", use_rope_scaling=True,
              rope_scaling_low_freq_factor=4.0), "must satisfy 0 < low < high"),
        (dict(position_embedding_type="rope", use_rope_scaling=True,
              rope_scaling_original_max_position_embeddings=0),
         "rope_scaling_original_max_position_embeddings=0 must be a positive integer"),
        (dict(position_embedding_type="rope", no_rope_freq=3),
         "no_rope_freq=3 must be a positive integer dividing num_layers=4"),
        (dict(position_embedding_type="rope", no_rope_freq=[0, 1]),
         r"no_rope_freq=\[0, 1\] must be an integer or 4 values \(num_layers\) of 0 or 1"),
        (dict(no_rope_freq=2), "no_rope_freq=2 needs rotary embeddings"),
        (dict(qk_l2_norm_layers="rope"), "qk_l2_norm_layers='rope' needs qk_l2_norm=True"),
        (dict(qk_l2_norm=True, qk_l2_norm_layers="nope"), "qk_l2_norm_layers='nope' must be"),
        (dict(position_embedding_type="rope", multi_latent_attention=True,
              rotary_interleaved=True), "rotary_interleaved=True does not work with multi_"),
        (dict(position_embedding_type="rope", multi_latent_attention=True, qk_l2_norm=True),
         "qk_l2_norm=True is not supported with multi_latent_attention"),
        (dict(attention_chunk_size=8), "attention_chunk_size=8 applies to the layers with "
                                        "rotary embeddings"),
        (dict(position_embedding_type="rope", attention_chunk_size=0),
         "attention_chunk_size=0 must be a positive integer"),
        (dict(position_embedding_type="rope", attention_chunk_size=8, window_size=(3, 0)),
         "choose one way of limiting attention"),
        (dict(position_embedding_type="rope", attn_temperature_floor_scale=8),
         "attn_temperature_floor_scale=8 scales the queries of the layers without rotary "
         "embeddings: it needs no_rope_freq"),
        (dict(attn_temperature_scale=0.2), "attn_temperature_scale=0.2 needs attn_temperature_"),
        (dict(position_embedding_type="rope", window_rotary_base=10000),
         "window_rotary_base=10000 needs window_size"),
        (dict(window_size=(3, 0), window_rotary_base=10000),
         "window_rotary_base=10000 needs position_embedding_type 'rope' or 'yarn'"),
        (dict(position_embedding_type="rope", window_size=(3, 0), window_rotary_base=0),
         "window_rotary_base=0 must be a positive integer"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0 must be a positive integer"),
        (dict(query_pre_attn_scalar=256, use_mup=True),
         "query_pre_attn_scalar=256 with use_mup: muP's attention scale"),
        (dict(position_embedding_type="rope", multi_latent_attention=True,
              query_pre_attn_scalar=256), "query_pre_attn_scalar=256 with multi_latent_attent"),
        (dict(residual_multiplier=0.0), "residual_multiplier=0.0 must be a finite number > 0"),
        (dict(position_embedding_type="rope", query_log_scale_beta=0.0),
         "query_log_scale_beta=0.0 must be a finite number > 0"),
        (dict(query_log_scale_length=8192), "query_log_scale_length=8192 needs query_log_scal"),
        (dict(position_embedding_type="rope", query_log_scale_beta=0.1,
              query_log_scale_length=0), "query_log_scale_length=0 must be a positive integer"),
        (dict(query_log_scale_beta=0.1), "query_log_scale_beta=0.1 scales the queries of the "
         "rotating layers: it needs position_embedding_type 'rope' or 'yarn'"),
        (dict(position_embedding_type="rope", query_log_scale_beta=0.1, window_size=(3, 0),
              window_rotary_base=10000),
         "query_log_scale_beta=0.1 with window_rotary_base=10000 is not implemented"),
        (dict(logits_scaling=2.0, use_mup=True), "logits_scaling=2.0 with use_mup: muP sets"),
        (dict(word_embedding_multiplier=12.0, use_mup=True),
         "word_embedding_multiplier=12.0 with use_mup"),
        (dict(sublayer_norm="after"), "sublayer_norm='after' must be one of input, output"),
        (dict(qk_layernorm_scope="all_heads"),
         "qk_layernorm_scope='all_heads' needs qk_layernorm=True without qk_l2_norm"),
        (dict(qk_layernorm=True, qk_layernorm_scope="all_heads", normalization="LayerNorm"),
         "qk_layernorm_scope='all_heads' with normalization='LayerNorm': it is an RMSNorm"),
        (dict(sublayer_norm="output", recompute_granularity="selective",
              recompute_modules=["layernorm"]),
         "recompute_modules 'layernorm' with sublayer_norm='output': the layers have no input"),
        (dict(qk_layernorm=True, qk_layernorm_scope="all_heads", normalization="RMSNorm",
              multi_latent_attention=True, position_embedding_type="rope"),
         "qk_layernorm_scope='all_heads' with multi_latent_attention"),
        (dict(sublayer_norm="both", hybrid_layer_pattern="M*M*"),
         "sublayer_norm='both' with hybrid_layer_pattern"),
        (dict(recompute_modules=["core_attn", "mhc"]),
         r"recompute_modules: 'mhc' \(hyper-connections\) is not implemented"),
        (dict(recompute_modules=["attention"]), "recompute_modules: 'attention' is not one of"),
        (dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"]),
         "'gdn_norm_out' needs gated DeltaNet"),
        (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
         r"'moe_act' needs moe_grouped_gemm \(--moe-grouped-gemm\)"),
        (dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
         r"'mla_up_proj' needs multi_latent_attention"),
        (dict(hybrid_layer_pattern="M*-D"), r"'D' \(DeepSeek sparse attention layers\) is "
                                             "not implemented"),
        (dict(hybrid_layer_pattern="M*-G", activation="swiglu", linear_num_value_heads=6),
         "linear_num_key_heads=16 does not divide linear_num_value_heads=6"),
        (dict(hybrid_layer_pattern="M*-G"), "activation='gelu' with gated DeltaNet layers: "
                                            "Megatron's GatedDeltaNet"),
        (dict(hybrid_layer_pattern="M*||-"), "pipeline segment 1 holds no layers"),
        (dict(hybrid_layer_pattern="M*-M/*|-", mtp_num_layers=1, position_embedding_type="none"),
         "'\\|' separates the decoder's pipeline segments, not multi-token"),
        (dict(hybrid_layer_pattern="M*-x"), "'x' is not a layer symbol"),
        (dict(hybrid_layer_pattern="M*-"), "has 3 decoder layers, num_layers=4: one symbol"),
        (dict(hybrid_layer_pattern="M*-E"), "has E layers: they need num_moe_experts"),
        (dict(hybrid_layer_pattern="M*-M", mtp_num_layers=1, position_embedding_type="none"),
         "mtp_num_layers=1 in a hybrid model needs the layers of its modules"),
        (dict(hybrid_layer_pattern="M*-M", mamba_num_groups=3),
         "mamba_num_groups=3 does not divide the 8 Mamba heads"),
        (dict(hybrid_layer_pattern="M*-M", mamba_head_dim=48),
         "mamba_head_dim=48 does not divide the Mamba inner width 512"),
        (dict(bf16=True, fp16=True), "bf16=True and fp16=True are exclusive"),
        (dict(recompute_granularity="full"), "needs recompute_method"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
         r"recompute_num_layers=0 must be >= 1"),
        (dict(recompute_granularity="selective", recompute_method="block"),
         "apply only to recompute_granularity='full'"),
        (dict(recompute_method="diagonal"), "recompute_method='diagonal' must be one of"),
        (dict(recompute_granularity="partial"), "recompute_granularity='partial'"),
    ],
)  # fmt: skip
def test_invalid_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**(BASE | kwargs))


ALL_HEADS = dict(num_query_groups=2, qk_layernorm=True, qk_layernorm_scope="all_heads",
                 normalization="RMSNorm")  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "tp", "message"),
    [
        (dict(), 3, "tensor_model_parallel_size=3 does not divide num_attention_heads=8"),
        (
            dict(num_attention_heads=12, num_query_groups=6, kv_channels=16),
            4,
            "tensor_model_parallel_size=4 does not divide num_query_groups=6",
        ),
        # fewer groups than ranks: each group shared by tp / groups ranks
        (
            dict(num_attention_heads=12, num_query_groups=3, kv_channels=16),
            4,
            "num_query_groups=3 is fewer than tensor_model_parallel_size=4 and does not divide",
        ),
        (
            dict(num_query_groups=1, kv_channels=4),
            8,
            "kv_channels=4: the 8 tensor-parallel ranks sharing each of num_query_groups=1",
        ),
        (dict(ffn_hidden_size=1002), 4, "does not divide ffn_hidden_size=1002"),
        (dict(sequence_parallel=True), 1, "sequence_parallel=True needs tensor_model_parallel"),
        (
            ALL_HEADS,
            4,
            "qk_layernorm_scope='all_heads' with num_query_groups=2 < tensor_model_parallel_size",
        ),
    ],
)
def test_rules_that_depend_on_the_tensor_parallel_size(kwargs, tp, message):
    config = TransformerConfig(**(BASE | kwargs))
    with pytest.raises(ValueError, match=message):
        config.check_parallel(tp)


def test_fewer_query_groups_than_ranks_are_shared():
    """Megatron-LM's rule: tp a multiple of num_query_groups (and here kv_channels split
    over the ranks sharing a group)."""
    for groups, tp in ((1, 2), (1, 8), (2, 4), (4, 8)):
        TransformerConfig(**BASE, num_query_groups=groups).check_parallel(tp)


def test_moe_layer_recompute_is_selective_recompute_with_moe_added():
    """As Megatron-LM's TransformerConfig reads its deprecated flag."""
    moe = dict(BASE, num_moe_experts=4, moe_layer_recompute=True)
    plain = TransformerConfig(**moe)
    assert plain.recompute_granularity == "selective"
    assert plain.recompute_modules == ["core_attn", "moe"]
    given = TransformerConfig(**moe, recompute_granularity="selective", recompute_modules=["mlp"])
    assert given.recompute_modules == ["mlp", "moe"]
    with pytest.raises(ValueError, match="moe_layer_recompute=True with recompute_granularity"):
        TransformerConfig(**moe, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1)  # fmt: skip


def test_moe_fields_given_to_a_dense_model_are_named_as_changing_nothing():
    # Megatron-LM accepts them without experts; the ones that would make a model a MoE
    # one (a shared expert, a capacity, the aux loss, ...) are refused above.
    with pytest.warns(UserWarning, match=r"^moe_router_topk=4, moe_token_dispatcher_type="
                      r"'alltoall' without num_moe_experts: .* change nothing"):  # fmt: skip
        TransformerConfig(**BASE, moe_router_topk=4, moe_token_dispatcher_type="alltoall")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerConfig(**BASE)  # every MoE field at its default: nothing to say
        TransformerConfig(**BASE, num_moe_experts=4, moe_router_topk=4)


def test_valid_layouts_pass():
    TransformerConfig(**BASE, num_query_groups=4, sequence_parallel=True).check_parallel(4)


def test_layer_specs():
    from mp_layers import LOCAL_SPEC, LayerSpec, get_layer_spec
    from mp_layers.transformer.core_attention import CoreAttention

    assert get_layer_spec("local") is LOCAL_SPEC and LOCAL_SPEC.core_attention is CoreAttention
    custom = LayerSpec("custom")
    assert get_layer_spec(custom) is custom
    with pytest.raises(ValueError, match="unknown layer spec 'te'; available: local"):
        get_layer_spec("te")


def test_a_spec_chooses_the_implementation():
    from mp_layers import GPTModel, LayerSpec

    class CountingNorm(torch.nn.LayerNorm):
        built = 0

        def __init__(self, size, eps):
            super().__init__(size, eps=eps)
            CountingNorm.built += 1

    spec = LayerSpec(
        "counting", norm=lambda c, h: CountingNorm(h or c.hidden_size, c.layernorm_epsilon)
    )
    config = TransformerConfig(**BASE, attention_dropout=0.0, hidden_dropout=0.0)
    GPTModel(config, spec, 64, 16, groups=ModelGroups.single())
    assert CountingNorm.built == 2 * 4 + 1  # two per layer and the final norm


def test_context_parallel_rules():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4)
    TransformerConfig(**base, cp_comm_type="a2a+p2p")  # with mp-state's hierarchical groups
    with pytest.raises(ValueError, match=r"cp_comm_type='ring' must be one of p2p, all_gather"):
        TransformerConfig(**base, cp_comm_type="ring")
    a2a = TransformerConfig(**base, cp_comm_type="a2a", attention_dropout=0.0)
    a2a.check_parallel(2, 2)  # 4 groups / tp 2 = 2 per rank, split over cp 2
    with pytest.raises(ValueError, match=r"rank's 2 of num_query_groups=4 \(tensor_model_paral"):
        a2a.check_parallel(2, 4)
    a2a.check_parallel(8, 1)  # each group shared by two ranks: one key/value head per rank
    with pytest.raises(ValueError, match=r"rank's 1 of num_query_groups=4 \(tensor_model_paral"):
        a2a.check_parallel(8, 2)
    for comm_type in ("p2p", "all_gather", "a2a+p2p"):  # attention_dropout 0.1, Megatron's
        TransformerConfig(**base, cp_comm_type=comm_type).check_parallel(1, 4)


def test_sinkhorn_routing_refuses_what_it_would_not_read():
    moe = dict(BASE, num_moe_experts=4, moe_router_topk=1,
               moe_router_load_balancing_type="sinkhorn")  # fmt: skip
    TransformerConfig(**moe)  # top-1 without pre-softmax: sinkhorn weighs by the sigmoid
    for extra, message in (
        (dict(moe_aux_loss_coeff=0.01), "balances without a loss"),
        (dict(moe_expert_capacity_factor=1.0), "only works with aux_loss, seq_aux_loss"),
        (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
         "moe_router_enable_expert_bias=True with moe_router_load_balancing_type='sinkhorn'"),
        (dict(moe_router_topk_scaling_factor=2.0), "moe_router_topk_scaling_factor=2.0 with"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            TransformerConfig(**(moe | extra))


def test_recompute_method_and_layers_without_a_granularity_warn_that_they_change_nothing():
    """As Megatron-LM reads them (one of its own test lines gives --recompute-num-layers
    alone): nothing is recomputed."""
    for extra in (dict(recompute_num_layers=1), dict(recompute_method="uniform")):
        with pytest.warns(UserWarning, match="without recompute_granularity: nothing is"):
            config = TransformerConfig(**BASE, **extra)
        assert config.recompute_granularity is None
