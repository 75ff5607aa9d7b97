"""Every family of mp_ckpt.families, from a random transformers model (small config, no
downloads): `mp-ckpt import-hf` gives transformers' fp32 logits within 1e-5 in GPTModel
(built from the imported settings alone); `mp-ckpt export-hf` without --arch (the
checkpoint remembers its family) gives back the config and every tensor; greedy
generation equals generate(do_sample=False) over 32 new tokens (DeepSeek's through the
cache of latents, DeepSeek-V3.2's with its indexer's keys, GLM-5's also where layers
reuse another layer's choice of positions, Nemotron-H's through its Mamba layers' states,
Qwen3-Next's through its gated DeltaNet layers'); gpt-oss's also over 72 at PP2, past its
windowed layers' cache rings, and DeepSeek-V3's, DeepSeek-V3.2's, GLM-5's (layers
sharing a choice) and Qwen3-MoE's at TP2 x EP2. DeepSeek-V3's and Nemotron 3 Super's
multi-token prediction layers import, compute as their own blocks do and export back."""

import importlib
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mp_ckpt.cli import main
from mp_ckpt.hf import logical_from_hf
from mp_gpt.testing import GIVEN_PEAK, greedy_on_rank, imported_model, reference_greedy
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SEQ, NEW = 16, 32
PROMPTS = [[5, 17, 3, 88, 41], [9], [60, 2, 2, 71, 30, 12, 33]]
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.1)  # fmt: skip
MOE = dict(SMALL, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, intermediate_size=80)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 16}  # fmt: skip
GPT_OSS = dict(SMALL, num_hidden_layers=3, head_dim=16, num_local_experts=4,
               num_experts_per_tok=2, intermediate_size=32, sliding_window=4,
               rope_parameters=YARN, swiglu_limit=1.5)  # fmt: skip
# DeepSeek: multi-latent attention with YaRN (its softmax scale included), layer 0 a dense
# MLP, layer 1 routed experts beside shared experts
MLA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 16, "mscale": 0.707,
            "mscale_all_dim": 0.9}  # fmt: skip
DEEPSEEK = dict(SMALL, num_attention_heads=4, num_key_value_heads=4, intermediate_size=80,
                moe_intermediate_size=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                first_k_dense_replace=1, rope_parameters=MLA_YARN)  # fmt: skip
DEEPSEEK_V3 = dict(DEEPSEEK, q_lora_rank=24, n_group=2, topk_group=1, n_shared_experts=1,
                   routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                   scoring_func="sigmoid", topk_method="noaux_tc")  # fmt: skip
# DeepSeek-V3.2: DeepSeek-V3's with a lightning indexer of 16 heads of 16 in each layer,
# each query attending to the 4 earlier positions it scores best (of up to 16 here, 39 in
# generation). A position whose every head's q . k is negative scores exactly 0 (the
# ReLU's), and with few heads (4: one in 16 positions) several such positions tie for the
# last places, which torch.topk breaks by the row's length: transformers' generate then
# differs from its own forward over the same tokens. DeepseekV32Config counts no
# multi-token prediction layers.
DEEPSEEK_V32 = {k: v for k, v in DEEPSEEK_V3.items() if k != "num_nextn_predict_layers"} | dict(
    index_n_heads=16, index_head_dim=16, index_topk=4)  # fmt: skip
# GLM-5: DeepSeek-V3.2's, its indexer rotating in interleaved pairs, with GLM-5's
# rms_norm_eps (1e-5), which transformers' latent norms leave at 1e-6 (latent_norm_epsilon)
GLM_MOE_DSA = DEEPSEEK_V32 | dict(rms_norm_eps=1e-5)
# GLM-4.5: grouped-query attention with biases, DeepSeek-V3's routing and shared expert;
# transformers saves no multi-token prediction layer
GLM4_MOE = dict(SMALL, num_hidden_layers=3, head_dim=16, intermediate_size=80,
                moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                first_k_dense_replace=1, attention_bias=True,
                num_nextn_predict_layers=0)  # fmt: skip
GLM4_MOE_LITE = {k: v for k, v in DEEPSEEK_V3.items()
                 if k not in ("first_k_dense_replace", "num_nextn_predict_layers", "scoring_func",
                              "topk_method")} | dict(mlp_layer_types=["dense", "sparse"],
                                                     rms_norm_eps=1e-5)  # fmt: skip
GEMMA3 = dict(SMALL, num_hidden_layers=7, head_dim=16, intermediate_size=96, sliding_window=4,
              query_pre_attn_scalar=12, pad_token_id=None, bos_token_id=None,
              eos_token_id=None, rope_parameters={
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                     "rope_theta": 1000000.0}})  # fmt: skip
GLM4 = dict(SMALL, intermediate_size=96, head_dim=16, pad_token_id=None, eos_token_id=None)
EXAONE4 = dict(SMALL, num_hidden_layers=4, intermediate_size=96, sliding_window=4,
               bos_token_id=None, eos_token_id=None)  # fmt: skip
OLMO3 = dict(SMALL, num_hidden_layers=4, intermediate_size=96, sliding_window=4,
             pad_token_id=None)  # fmt: skip
# OLMoE: experts of intermediate_size (32), no dense width
OLMOE = {k: v for k, v in MOE.items() if k != "moe_intermediate_size"} | dict(
    intermediate_size=32, pad_token_id=None)  # fmt: skip
SMOLLM3 = dict(SMALL, intermediate_size=96, head_dim=8, pad_token_id=None)
PHI3 = dict(SMALL, intermediate_size=96, pad_token_id=None, original_max_position_embeddings=64)
# Llama 4: 4 layers, experts of 32 beside a shared expert of 32, dense layers of 48
LLAMA4 = dict(SMALL, num_hidden_layers=4, head_dim=16, intermediate_size=32,
              intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
# Nemotron-H: Mamba-2 mixers (8 heads of 8 channels in 2 groups, chunks of 8 that the
# prompts cross), attention without positional embeddings, squared-ReLU MLPs
NEMOTRON_H = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                  ssm_state_size=16, chunk_size=8, intermediate_size=80,
                  max_position_embeddings=64, initializer_range=0.1)  # fmt: skip
# Granite 3.0 MoE: Granite's four scales over Mixtral-like layers of 4 experts (stacked,
# each one's gate and up projections fused)
GRANITE_MOE = dict(SMALL, num_hidden_layers=3, intermediate_size=32, num_local_experts=4,
                   num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
                   embedding_multiplier=12.0, attention_multiplier=0.0078125,
                   residual_multiplier=0.22, logits_scaling=4.0)  # fmt: skip
# Granite 4: Nemotron-H's mixers (8 heads of 8 channels in 2 groups, chunks of 8) as
# Granite's layers, each a mixer then the shared MLP (of 48), beside 4 experts or alone
GRANITE_HYBRID = dict(GRANITE_MOE, num_hidden_layers=4, shared_intermediate_size=48,
                      mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16,
                      mamba_chunk_size=8, mamba_expand=1,
                      layer_types=["mamba", "attention", "mamba", "mamba"])  # fmt: skip
BAMBA = dict(SMALL, intermediate_size=48, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
             mamba_d_state=16, mamba_chunk_size=8, mamba_expand=1)  # fmt: skip
MINISTRAL3_ROPE = {"rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                   "original_max_position_embeddings": 8, "max_position_embeddings": 64,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}  # fmt: skip
# Qwen3-Next: gated DeltaNet layers (2 key heads of 8 channels, 4 value heads of 12) and
# gated attention with a quarter of each head rotated, experts beside a gated shared expert;
# weights of std 0.02 (at SMALL's 0.1 the model's own fp32 rounding reaches 1.2e-5 in its
# logits, mp's and transformers' alike against mp in fp64)
QWEN3_NEXT = dict(SMALL, initializer_range=0.02, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)  # fmt: skip
CASES = {
    # Qwen2.5: q/k/v biases; the small sizes tie the output layer
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, intermediate_size=96),
    "qwen2-tied": lambda: transformers.Qwen2Config(**SMALL, intermediate_size=96,
                                                   tie_word_embeddings=True),
    # Qwen3: qk-layernorm, head_dim 16 where hidden / heads is 8
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=96, head_dim=16,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1000000.0}),
    # Qwen3-MoE: normalized top-k, layer 1 dense, no shared expert
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**MOE, head_dim=16, norm_topk_prob=True,
                                                     mlp_only_layers=[1]),
    "qwen3_moe-full-softmax": lambda: transformers.Qwen3MoeConfig(**MOE, head_dim=16,
                                                                  decoder_sparse_step=2),
    # Nemotron: LayerNorm1P with biases, squared ReLU, half of each head rotated
    "nemotron": lambda: transformers.NemotronConfig(**SMALL, intermediate_size=96, head_dim=8),
    # gpt-oss: sinks, a window of 4 on layers 0 and 2 (sequences of 16 reach past it),
    # YaRN, biases everywhere, clamped quick GEGLU experts with softmax after the top k
    "gpt_oss": lambda: transformers.GptOssConfig(**GPT_OSS),
    "gpt_oss-no-truncate-full-layers": lambda: transformers.GptOssConfig(
        **GPT_OSS | {"layer_types": ["full_attention"] * 3,
                     "rope_parameters": YARN | {"truncate": False, "factor": 8.0}}),
    # SmolLM3: Llama's layers, every 4th without rotary embeddings; a NoPE layer given
    # as a list instead, tied as the released 3B (its pad id, 128004, past this vocabulary)
    "smollm3": lambda: transformers.SmolLM3Config(**SMOLLM3 | {"num_hidden_layers": 4}),
    "smollm3-listed-tied": lambda: transformers.SmolLM3Config(
        **SMOLLM3, no_rope_layers=[0, 1], tie_word_embeddings=True),
    # Phi-3 / Phi-4: q, k, v and gate, up fused; half of each head rotated and a window
    # of 4 that the prompts cross, tied; Phi-4's full rotation without a window
    "phi3": lambda: transformers.Phi3Config(**PHI3, partial_rotary_factor=0.5,
                                            sliding_window=4, tie_word_embeddings=True),
    "phi3-phi4": lambda: transformers.Phi3Config(**PHI3, rope_theta=250000.0),
    # ERNIE 4.5: channel pairs (2i, 2i + 1) rotated, its own head dim, tied; untied
    "ernie4_5": lambda: transformers.Ernie4_5Config(**SMALL, intermediate_size=96, head_dim=16,
                                                    pad_token_id=None),
    "ernie4_5-untied": lambda: transformers.Ernie4_5Config(
        **SMALL, intermediate_size=96, head_dim=8, pad_token_id=None, tie_word_embeddings=False),
    # Seed-OSS: q/k/v biases, its own head dim, dropouts (inactive in eval); without biases
    "seed_oss": lambda: transformers.SeedOssConfig(**SMALL, intermediate_size=96, head_dim=16,
                                                   pad_token_id=None),
    "seed_oss-no-bias": lambda: transformers.SeedOssConfig(
        **SMALL, intermediate_size=96, pad_token_id=None, attention_bias=False),
    # OLMo 2: each sublayer's output normalized, queries and keys over all heads; MHA, tied
    "olmo2": lambda: transformers.Olmo2Config(**SMALL, intermediate_size=96, pad_token_id=None),
    "olmo2-mha-tied": lambda: transformers.Olmo2Config(
        **SMALL | {"num_key_value_heads": 8}, intermediate_size=96, pad_token_id=None,
        tie_word_embeddings=True),
    # OLMo 3: OLMo 2's layers, a window of 4 on three layers in four (the default
    # pattern), plain RoPE everywhere; the released long-context form: YaRN on the full
    # layers (its attention factor written out), the sliding ones unscaled
    "olmo3": lambda: transformers.Olmo3Config(**OLMO3),
    "olmo3-yarn": lambda: transformers.Olmo3Config(**OLMO3, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                           "original_max_position_embeddings": 8,
                           "attention_factor": 0.1 * math.log(8.0) + 1, "beta_fast": 32,
                           "beta_slow": 1}}),
    # Gemma 3: sandwich norms of 1 + w, gated tanh-GELU, embeddings times sqrt(64), scores
    # scaled by 1 / sqrt(query_pre_attn_scalar) (12, not the head width 16), a window of 4
    # on five layers in six whose RoPE base (10,000) is not the full layers' (1e6, with
    # linear scaling by 8 as the 4B and larger models); tied
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**GEMMA3),
    # a 270M-like shape: one full layer in two given as layer_types, unscaled, MHA
    "gemma3_text-layer-types": lambda: transformers.Gemma3TextConfig(
        **GEMMA3 | {"num_hidden_layers": 2, "num_key_value_heads": 8,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
    # MiniMax-M2: OLMo 2's query and key norms in pre-norm layers of experts routed by
    # sigmoid scores + the correction bias (random, below), half of each head rotated
    # (rotary_dim, as released)
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **SMALL | {"num_hidden_layers": 3}, head_dim=16, rotary_dim=8, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None),
    # GLM-4 (dense, 0414): sandwich norms, q/k/v biases, half of each head rotated in
    # neighbouring pairs, gate and up fused; without biases, a quarter rotated
    "glm4": lambda: transformers.Glm4Config(**GLM4),
    "glm4-no-bias": lambda: transformers.Glm4Config(
        **GLM4, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25}),
    # EXAONE 4.0 (32B's layout): each sublayer's output normalized, per-head query/key
    # norms, a window of 4 on three layers in four, the fourth attending fully without
    # rotary embeddings; the 1.2B's: no window, every layer rotating
    "exaone4": lambda: transformers.Exaone4Config(**EXAONE4),
    "exaone4-no-window": lambda: transformers.Exaone4Config(
        **EXAONE4 | {"sliding_window": None, "num_hidden_layers": 2,
                     "layer_types": ["full_attention"] * 2}),
    # Arcee (AFM-4.5B): Llama's layers with an ungated squared-ReLU MLP, YaRN as released
    # (its attention factor derived; the export writes beta_fast and beta_slow out);
    # plain RoPE, tied
    "arcee": lambda: transformers.ArceeConfig(
        **SMALL, intermediate_size=96, head_dim=16, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0}),
    "arcee-tied": lambda: transformers.ArceeConfig(
        **SMALL, intermediate_size=96, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=True),
    # FlexOlmo: OLMo 2's layers with OLMoE's experts (the full softmax's top-k weights)
    "flex_olmo": lambda: transformers.FlexOlmoConfig(**OLMOE),
    # Granite 3.x: Llama's layers with the embeddings times 12, the softmax scale 1/128
    # (not 1 / sqrt(16)), each sublayer's output times 0.22, the logits divided by 4
    "granite": lambda: transformers.GraniteConfig(
        **SMALL, intermediate_size=96, head_dim=16, bos_token_id=None, eos_token_id=None,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
        logits_scaling=4.0),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**GRANITE_MOE, tie_word_embeddings=True),
    # with a shared MLP of 48 beside the experts
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(
        **GRANITE_MOE, shared_intermediate_size=48),
    # Granite 4.0-H: Mamba and attention (without positional embeddings) mixers, each then
    # experts beside the shared MLP
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(**GRANITE_HYBRID),
    # Granite 4.0-H-Micro-like: the shared MLP alone; rotary embeddings in attention
    "granitemoehybrid-dense": lambda: transformers.GraniteMoeHybridConfig(
        **GRANITE_HYBRID | dict(num_local_experts=0, intermediate_size=48,
                                position_embedding_type="rope",
                                layer_types=["attention", "mamba", "attention"],
                                num_hidden_layers=3)),
    # Bamba: Granite 4's mixers (no multipliers) each then a SwiGLU MLP, half of each
    # attention head rotated
    "bamba": lambda: transformers.BambaConfig(
        **BAMBA | dict(num_hidden_layers=4, attn_layer_indices=[1, 2])),
    # Gemma (2B's shape): multi-query attention with heads of 16, zero-centred norms, the
    # gated tanh-GELU (the released configs' hidden_act "gelu"), scaled embeddings, tied
    "gemma": lambda: transformers.GemmaConfig(
        **SMALL | dict(num_key_value_heads=1), head_dim=16, intermediate_size=96,
        hidden_act="gelu"),
    # Ministral 3: YaRN (factor 4 over 8 positions) and the rotated queries scaled by
    # 1 + 0.5 ln(1 + floor(p / 8)), which the prompts and generated tokens cross
    "ministral3": lambda: transformers.Ministral3Config(
        **SMALL, head_dim=16, intermediate_size=96, rope_parameters=MINISTRAL3_ROPE),
    "ministral3-rope": lambda: transformers.Ministral3Config(
        **SMALL, head_dim=16, intermediate_size=96, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 8}),
    # OLMoE: OLMo 2's query and key norms in pre-norm layers of experts, the full
    # softmax's top-k weights (as released); renormalized
    "olmoe": lambda: transformers.OlmoeConfig(**OLMOE),
    "olmoe-norm-topk": lambda: transformers.OlmoeConfig(**OLMOE | {"num_hidden_layers": 2},
                                                        norm_topk_prob=True),
    # Mistral: Llama's layers, a window (4096, the default) no sequence here reaches
    "mistral": lambda: transformers.MistralConfig(**SMALL, intermediate_size=96, head_dim=8),
    "mistral-no-window": lambda: transformers.MistralConfig(**SMALL, intermediate_size=96,
                                                            sliding_window=None),
    # DeepSeek-V3: a query latent, sigmoid routing within 1 of 2 groups of 4 experts by
    # score + the correction bias (random, below), weights scaled by 2.5, 1 shared expert
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK_V3),
    # DeepSeek-V3.2: DeepSeek-V3's layers and routing with sparse attention (YaRN scaling
    # the indexer's rotated channels too)
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**DEEPSEEK_V32),
    # GLM-4.5: q/k/v biases, half of each head rotated (in halves), layer 0 dense, then
    # sigmoid routing within 1 of 2 groups of 4 experts by score + the correction bias
    # (random, below), weights scaled by 2.5, a shared expert; GLM-4.6's query/key norms
    "glm4_moe": lambda: transformers.Glm4MoeConfig(**GLM4_MOE),
    "glm4_moe-qk-norm": lambda: transformers.Glm4MoeConfig(
        **GLM4_MOE | dict(use_qk_norm=True, partial_rotary_factor=0.25, attention_bias=False)),
    # GLM-4.7-Flash: DeepSeek-V3's layers and routing, its dense and expert layers listed
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(**GLM4_MOE_LITE),
    # GLM-5: the indexer's positional channels turned in interleaved pairs
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(**GLM_MOE_DSA),
    # its indexer shared across layers: layers 0, 1 and 3 choose their positions, layer 2
    # attends to those layer 1 chose (index_topk_freq 2 after the first 2 layers)
    "glm_moe_dsa-shared": lambda: transformers.GlmMoeDsaConfig(
        **GLM_MOE_DSA | dict(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=2)),
    # DeepSeek-V2-Lite: queries from the hidden state, softmax routing without groups or
    # renormalization, 2 shared experts
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **DEEPSEEK, q_lora_rank=None, n_shared_experts=2, scoring_func="softmax"),
    # Llama 4 Scout's shape: experts on every layer, layer 1 without rotary embeddings
    # (its queries scaled from position 5 on), L2-normalized queries and keys on the others,
    # which attend within blocks of 8 positions (crossed by the prompts and the generated
    # tokens), Llama 3.1's rotary scaling
    "llama4_text-scout": lambda: transformers.Llama4TextConfig(
        **LLAMA4, no_rope_layers=[1, 0, 1, 1], rope_parameters=LLAMA3_ROPE,
        attention_chunk_size=8, floor_scale=6, attn_scale=0.5),
    # Llama 4 Maverick's: dense and expert layers alternating (layer 3 without rotary
    # embeddings: the interval 4), no query/key norm
    "llama4_text-maverick": lambda: transformers.Llama4TextConfig(
        **LLAMA4, interleave_moe_layer_step=2, use_qk_norm=False),
    # Nemotron-H-like: Mamba, MLP and attention layers (the older layer type names)
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **NEMOTRON_H, layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]),
    # Nemotron 3-like: expert layers (sigmoid routing by score + correction bias within 1 of
    # 2 groups of 4 experts, weights scaled by 2.5, a shared expert)
    "nemotron_h-moe": lambda: transformers.NemotronHConfig(
        **NEMOTRON_H, layers_block_type=["mamba", "moe", "mamba", "full_attention", "moe", "mlp"],
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
        routed_scaling_factor=2.5),
    # Nemotron 3 Super-like: a latent MoE (the experts at width 12, projected from and
    # back to the hidden 64), one group
    "nemotron_h-latent": lambda: transformers.NemotronHConfig(
        **NEMOTRON_H, layers_block_type=["mamba", "moe", "full_attention", "moe"],
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1,
        routed_scaling_factor=5.0, moe_latent_size=12),
    # Qwen3.5 (dense): Qwen3-Next's layers with a SwiGLU MLP in each, the DeltaNet's input
    # projections apart, Qwen3-VL's multimodal rotary keys (text rotates as plain RoPE)
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **{k: v for k, v in QWEN3_NEXT.items() if not k.startswith(("num_experts", "moe_",
                                                                   "shared_expert"))},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True}),
    # Qwen3.5 MoE: its experts in every layer beside the gated shared expert
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in QWEN3_NEXT.items() if k != "intermediate_size"}),
    # Qwen3-Next: three DeltaNet layers then attention (full_attention_interval 4), layer 1
    # a dense MLP
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**QWEN3_NEXT, mlp_only_layers=[1]),
    # its layer types given, the full softmax's top-k weights, half of each head rotated
    "qwen3_next-layer-types": lambda: transformers.Qwen3NextConfig(
        **QWEN3_NEXT, norm_topk_prob=False, partial_rotary_factor=0.5,
        layer_types=["full_attention", "linear_attention", "linear_attention",
                     "full_attention"]),
}  # fmt: skip


def random_hf(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1: give them values to map
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router bias: a buffer
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)  # enough to change the choice
        for name, param in model.named_parameters():
            # Mamba's time step: transformers clamps softplus(dt + dt_bias) at time_step_min
            # (0.001), Megatron and mp do not (nemotron_h.py); a dt_bias in [-1, 1] keeps
            # dt + dt_bias well above where the clamp would act
            if name.endswith(("mixer.dt_bias", "mamba.dt_bias")):
                param.uniform_(-1.0, 1.0)
    return model


def hf_config_dict(folder) -> dict:
    config = transformers.AutoConfig.from_pretrained(folder).to_dict()
    config.pop("_name_or_path")
    config.pop("transformers_version", None)
    return config


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_imports_exactly_exports_back_and_generates_as_transformers(tmp_path, case):
    hf = random_hf(CASES[case]())
    hf.save_pretrained(tmp_path / "hf_in")
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    x = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (imported_model(tmp_path / "ckpt")(x) - hf(x).logits).abs().max() < 1e-5

    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out")]) == 0
    assert hf_config_dict(tmp_path / "hf_out") == hf_config_dict(tmp_path / "hf_in")
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    source = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name

    got = run_on_ranks(greedy_on_rank, 1, str(tmp_path / "ckpt"), [], PROMPTS, NEW,
                       timeout=180)[0]  # fmt: skip
    assert got == reference_greedy(hf, PROMPTS, NEW)


def finetune_body(load: str, save: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import main as pretrain

    pretrain([
        "--load", load, "--use-checkpoint-args", "--finetune", "--save", save,
        "--mock-data", *GIVEN_PEAK,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",  # its EOD: 95
        "--make-vocab-size-divisible-by", "1", "--seq-length", str(SEQ),
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
        "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-interval", "none",
        "--tensorboard-dir", "none", "--num-workers", "0", "--log-interval", "100",
    ])  # fmt: skip


def test_a_model_trained_from_an_import_exports_as_its_family(tmp_path):
    # Mistral without a window computes what Llama computes: only the recorded family
    # tells the export to write a Mistral config.
    hf = random_hf(CASES["mistral-no-window"]())
    hf.save_pretrained(tmp_path / "hf_in")
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    run_on_ranks(finetune_body, 1, str(tmp_path / "ckpt"), str(tmp_path / "run"), timeout=120)
    assert main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf_out")]) == 0
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf_out")
    assert config.model_type == "mistral"
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    assert type(trained).__name__ == "MistralForCausalLM"


@pytest.mark.multirank
def test_gpt_oss_generates_past_its_window_ring_through_two_stages_as_transformers(tmp_path):
    """Greedy generation past 64 positions, where each windowed layer's KVCache ring (64
    slots for the window of 4) wraps, at PP2 (layers 0-1, then 2: a cache per stage),
    equals transformers' generate."""
    hf = random_hf(transformers.GptOssConfig(**GPT_OSS | {"max_position_embeddings": 128}))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    layout = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]
    new = 72
    want = reference_greedy(hf, PROMPTS, new)
    for got in run_on_ranks(greedy_on_rank, 2, str(tmp_path / "ckpt"), layout, PROMPTS, new,
                            timeout=240):  # fmt: skip
        assert got == want


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa-shared",
                                  "glm4_moe", "qwen3_moe", "granitemoehybrid"])  # fmt: skip
def test_moe_families_generate_at_tp2_x_ep2_as_transformers(tmp_path, case):
    """Generation runs without sequence parallelism: at TP2 each tensor-parallel rank routes
    a share of the tokens (mp_layers' MoELayer), and at TP2 x EP2 greedy tokens equal
    transformers' generate, for the batch of three prompts and for one prompt alone, whose
    decode steps leave one tensor-parallel rank without a token (DeepSeek-V3's
    group-limited routing then routes a zero row nowhere). DeepSeek-V3.2's indexer is
    whole on each tensor-parallel rank, its heads' attention split; GLM-5's layer without
    an indexer reuses the positions an earlier layer chose on the same rank. Granite 4's
    Mamba mixers split by their groups of heads, one group on each rank."""
    hf = random_hf(CASES[case]())
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    layout = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = reference_greedy(hf, prompts, NEW)
        for got in run_on_ranks(greedy_on_rank, 4, str(tmp_path / "ckpt"), layout, prompts,
                                NEW, timeout=240):  # fmt: skip
            assert got == want


@pytest.mark.parametrize("case", ["minimax_m2", "granitemoehybrid"])
def test_transformers_in_memory_names_import_as_the_saved_ones(tmp_path, case):
    """transformers' MiniMax-M2 holds its experts fused and its router bias under mlp.,
    Granite's its experts as experts.gate_up_proj / down_proj and its router as
    router.weight; both save them as the released checkpoints name them
    (block_sparse_moe.*, input_linear, output_linear, router.layer): both forms import
    alike."""
    hf = random_hf(CASES[case]())
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    saved = logical_from_hf(load_file(str(tmp_path / "model.safetensors")), config)
    in_memory = logical_from_hf(hf.state_dict(), config)
    assert in_memory.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(in_memory[name], tensor), name


@pytest.mark.multirank
def test_olmo2_generates_at_tp2_as_transformers(tmp_path):
    """OLMo 2's query and key norms span all heads: at TP2 each rank holds half of their
    weights and the ranks add up their sums of squares; greedy tokens equal transformers'."""
    hf = random_hf(CASES["olmo2"]())
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    want = reference_greedy(hf, PROMPTS, NEW)
    for got in run_on_ranks(greedy_on_rank, 2, str(tmp_path / "ckpt"),
                            ["--tensor-model-parallel-size", "2"], PROMPTS, NEW,
                            timeout=240):  # fmt: skip
        assert got == want


def hf_folder_with(folder, config: dict, state: dict):
    """A Hugging Face folder of config.json and model.safetensors (weights transformers
    neither builds nor saves: multi-token prediction modules); transformers' model of it."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def assert_exported_back(tmp_path, state: dict):
    """export-hf of tmp_path/ckpt gives back tmp_path/hf_in's config.json and exactly
    `state`; transformers' model of the export."""
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out")]) == 0
    assert hf_config_dict(tmp_path / "hf_out") == hf_config_dict(tmp_path / "hf_in")
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    assert exported.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()


def imported_mtp_loss(hf_dir, ckpt, hf):
    """import-hf of hf_dir into ckpt: the model's logits are transformers' (1e-5); returns
    (inputs, labels, mp's MTP loss in a training forward)."""
    assert main(["import-hf", str(hf_dir), str(ckpt)]) == 0
    model = imported_model(ckpt)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    x, labels = torch.randint(0, hf.config.vocab_size, (2, 2, SEQ),
                              generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5
    model.train()
    model(x, labels=labels)
    return x, labels, model.mtp.take_losses()[0]


@torch.no_grad()
def reference_mtp_loss(hf, x, labels, embedding_norm, hidden_norm, projection, layer,
                       final_norm) -> torch.Tensor:  # fmt: skip
    """An MTP module composed of transformers' blocks: h' = layer(projection(cat(
    embedding_norm(embed(next tokens)), hidden_norm(h)))), lm_head(final_norm(h')) against
    the labels one further (the last position counts nothing)."""
    ahead = torch.roll(x, -1, 1)
    joined = torch.cat([embedding_norm(hf.model.embed_tokens(ahead)),
                        hidden_norm(hf.model(x).last_hidden_state)], -1)  # fmt: skip
    positions = torch.arange(SEQ)[None]
    mask = torch.full((SEQ, SEQ), -torch.inf).triu(1)[None, None]
    out = layer(joined @ projection.t(), attention_mask=mask, position_ids=positions,
                position_embeddings=hf.model.rotary_emb(joined, positions))  # fmt: skip
    logits = hf.lm_head(final_norm(out))[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.roll(labels, -1, 1)[:, :-1].reshape(-1)
    )


# family -> (its config class's name, its settings of 3 layers, its RMSNorm class's name)
MTP_FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK_V3 | {"num_hidden_layers": 3},
                    "DeepseekV3RMSNorm"),
    "glm4_moe": ("Glm4MoeConfig", GLM4_MOE, "Glm4MoeRMSNorm"),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(MTP_FAMILIES))
def test_deepseek_style_multi_token_prediction_imports_computes_as_its_blocks_and_exports_back(
    tmp_path, family
):
    """DeepSeek-V3's MTP module as its checkpoints hold it, and GLM-4.5's, laid out alike
    (model.layers.{L}.*: a decoder layer's weights, enorm, hnorm, eh_proj,
    shared_head.norm, and copies of the embedding and lm_head), which transformers' model
    neither builds nor saves: the third layer of a random 3-layer model with random norms
    and projection, beside the first two layers.
    import-hf makes it mp's mtp.layers.0, the logits stay transformers', mp's MTP loss
    equals the module computed from transformers' parts (h' = layer(eh_proj(cat(
    enorm(embed(next tokens)), hnorm(h)))), lm_head(shared_head.norm(h')) against the
    labels one further); export-hf gives back every tensor and num_nextn_predict_layers
    1, and transformers loads the export."""
    config_class, settings, norm_class = MTP_FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    three = random_hf(getattr(transformers, config_class)(**settings))
    three.save_pretrained(tmp_path / "three")
    state = load_file(str(tmp_path / "three" / "model.safetensors"))
    h, gen = three.config.hidden_size, torch.Generator().manual_seed(5)
    mtp = {name: 1 + 0.1 * torch.randn(h, generator=gen)
           for name in ("enorm", "hnorm", "shared_head.norm")}  # fmt: skip
    mtp["eh_proj"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    state |= {f"model.layers.2.{name}.weight": w for name, w in mtp.items()}
    state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    config = json.loads((tmp_path / "three" / "config.json").read_text())
    config |= {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    hf = hf_folder_with(tmp_path / "hf_in", config, state)
    x, labels, got = imported_mtp_loss(tmp_path / "hf_in", tmp_path / "ckpt", hf)
    norms = {}
    for name, weight in mtp.items():
        if name != "eh_proj":
            norms[name] = getattr(modeling, norm_class)(h, hf.config.rms_norm_eps)
            norms[name].weight.data.copy_(weight)
    want = reference_mtp_loss(hf, x, labels, norms["enorm"], norms["hnorm"], mtp["eh_proj"],
                              three.model.layers[2], norms["shared_head.norm"])  # fmt: skip
    assert abs(got.item() - want.item()) < 1e-5, (got, want)

    reloaded = assert_exported_back(tmp_path, state)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


def test_qwen3_next_multi_token_prediction_imports_computes_as_its_blocks_and_exports_back(
    tmp_path,
):
    """Qwen3-Next's MTP module as its released weights hold it (mtp.fc, pre_fc_norm_embedding,
    pre_fc_norm_hidden, norm, and mtp.layers.0.* a gated-attention decoder layer), which
    transformers' model neither builds nor loads: here the extra last layer of a random
    model longer by it, with random norms and fc. import-hf makes it mp's mtp.layers.0 (from
    the weights alone: config.json names no module); the logits stay transformers'; mp's MTP
    loss equals the module composed of transformers' blocks as vLLM computes it (h' =
    layer(fc(cat(pre_fc_norm_embedding(embed(next tokens)), pre_fc_norm_hidden(h)))),
    lm_head(norm(h')) against the labels one further); export-hf gives back every tensor."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    longer = random_hf(
        transformers.Qwen3NextConfig(
            **QWEN3_NEXT | {"num_hidden_layers": 5}, layer_types=[*types, "full_attention"]
        )
    )
    longer.save_pretrained(tmp_path / "longer")
    state = {}
    for name, tensor in load_file(str(tmp_path / "longer" / "model.safetensors")).items():
        state[name.replace("model.layers.4.", "mtp.layers.0.")] = tensor
    h, gen = QWEN3_NEXT["hidden_size"], torch.Generator().manual_seed(5)
    module = {name: 0.1 * torch.randn(h, generator=gen)  # (1 + w: zero-centred norms)
              for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}  # fmt: skip
    module["fc"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    state |= {f"mtp.{name}.weight": w for name, w in module.items()}
    config = json.loads((tmp_path / "longer" / "config.json").read_text())
    config |= {"num_hidden_layers": 4, "layer_types": types}
    hf = hf_folder_with(tmp_path / "hf_without_key", config, state)
    x, labels, got = imported_mtp_loss(tmp_path / "hf_without_key", tmp_path / "ckpt", hf)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3NextRMSNorm(h, hf.config.rms_norm_eps)
        norms[name].weight.data.copy_(module[name])
    want = reference_mtp_loss(hf, x, labels, norms["pre_fc_norm_embedding"],
                              norms["pre_fc_norm_hidden"], module["fc"], longer.model.layers[4],
                              norms["norm"])  # fmt: skip
    assert abs(got.item() - want.item()) < 1e-5, (got, want)

    (tmp_path / "hf_without_key").rename(tmp_path / "hf_in")  # the export names the module
    config_path = tmp_path / "hf_in" / "config.json"
    config_path.write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    reloaded = assert_exported_back(tmp_path, state)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_nemotron_3_multi_token_prediction_imports_computes_as_its_blocks_and_exports_back(
    tmp_path,
):
    """Nemotron 3 Super's MTP module as its checkpoints hold it (mtp.layers.{j}.*, one per
    layer of the module's pattern: each a decoder block's norm and mixer, the first also
    enorm, hnorm and eh_proj, the last final_layernorm), which transformers' NemotronH
    neither builds nor saves: here the extra blocks (Mamba, attention, latent MoE) of a
    random model longer by them. import-hf makes the module mp's (hybrid_layer_pattern
    "<main>/<mtp>"); the logits stay transformers'; mp's MTP loss equals the module
    composed of transformers' blocks (h' = final_layernorm(blocks(eh_proj(cat(
    enorm(embed(next tokens)), hnorm(h)))))), lm_head(h') against the labels one further);
    export-hf gives back every tensor and config.json, and transformers loads the export."""
    main_kinds, module_kinds = (
        ["mamba", "moe", "full_attention", "moe"],
        ["mamba", "full_attention", "moe"],
    )
    moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
               moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1,
               routed_scaling_factor=2.5, moe_latent_size=12)  # fmt: skip
    longer = random_hf(transformers.NemotronHConfig(
        **NEMOTRON_H, **moe, layers_block_type=main_kinds + module_kinds))  # fmt: skip
    longer.save_pretrained(tmp_path / "longer")
    state = {}
    for name, tensor in load_file(str(tmp_path / "longer" / "model.safetensors")).items():
        parts = name.split(".")
        if parts[:2] == ["backbone", "layers"] and int(parts[2]) >= len(main_kinds):
            name = ".".join(["mtp", "layers", str(int(parts[2]) - len(main_kinds)), *parts[3:]])
        state[name] = tensor
    h, gen = NEMOTRON_H["hidden_size"], torch.Generator().manual_seed(5)
    module = {
        "mtp.layers.0.enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        "mtp.layers.0.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        "mtp.layers.0.eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=gen),
        "mtp.layers.2.final_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    state |= module  # fmt: skip
    config = json.loads((tmp_path / "longer" / "config.json").read_text())
    config |= {"layers_block_type": main_kinds, "num_hidden_layers": len(main_kinds),
               "num_nextn_predict_layers": 1, "mtp_layers_block_type": module_kinds}  # fmt: skip
    hf = hf_folder_with(tmp_path / "hf_in", config, state)

    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    model = imported_model(tmp_path / "ckpt")
    assert model.config.hybrid_layer_pattern == "ME*E/M*E"
    x, labels = torch.randint(0, NEMOTRON_H["vocab_size"], (2, 2, SEQ),
                              generator=torch.Generator().manual_seed(3))  # fmt: skip
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5
    model.train()
    model(x, labels=labels)
    (got,) = model.mtp.take_losses().tolist()
    eps = hf.config.layer_norm_epsilon
    with torch.no_grad():
        ahead = torch.roll(x, -1, 1)  # the next tokens (the last position counts nothing)
        joined = torch.cat([
            rms_norm(hf.model.embeddings(ahead), module["mtp.layers.0.enorm.weight"], eps),
            rms_norm(hf.model(x).last_hidden_state, module["mtp.layers.0.hnorm.weight"], eps),
        ], -1)  # fmt: skip
        out = joined @ module["mtp.layers.0.eh_proj.weight"].t()
        mask = torch.full((SEQ, SEQ), -torch.inf).triu(1)[None, None]
        for block in longer.model.layers[len(main_kinds) :]:  # the Mamba block takes a 2D mask
            causal = mask if block.block_type == "full_attention" else None
            out = block(out, attention_mask=causal, position_ids=torch.arange(SEQ)[None])
        out = rms_norm(out, module["mtp.layers.2.final_layernorm.weight"], eps)
        logits = hf.lm_head(out)[:, :-1]
        want = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.roll(labels, -1, 1)[:, :-1].reshape(-1)
        )
    assert abs(got - want.item()) < 1e-5, (got, want)

    reloaded = assert_exported_back(tmp_path, state)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)
