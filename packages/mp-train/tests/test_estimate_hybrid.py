"""`estimate` for Mamba-hybrid models (hybrid_layer_pattern) against hand-worked figures
and Megatron-LM's own FLOPs formula (num_floating_point_operations' hybrid_flops,
transcribed below). Symbols as in mp_train.estimate.hybrid.

The model unless a test says otherwise: pattern "M-M*" (L = 4: two Mamba layers, an MLP
layer, an attention layer), h = 64, a = g = 4 (d = 16), f = 4h = 256 (gelu), LayerNorm, no
linear biases, rotary positions, tied embeddings; the mixers H = 8 heads of P = 16 (I =
128), G = 2 groups, N = 16: in_proj W = 2I + 2GN + H = 328, conv X = I + 2GN = 192. s =
32, b = 2, B = 4, vocabulary 100 (V = 128), bf16 with Adam."""

from __future__ import annotations

import json

import pytest

from mp_data import DataConfig
from mp_layers import TransformerConfig
from mp_optim import OptimizerConfig
from mp_state import ParallelConfig
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate, main
from mp_train.estimate.parameters import stage_layer_kinds

MB = 2**20


def make_config(*, pattern="M-M*", bf16=True, parallel=None, **model) -> RunConfig:
    fields = {"num_layers": len(pattern), "hidden_size": 64, "num_attention_heads": 4,
              "hybrid_layer_pattern": pattern, "mamba_num_heads": 8, "mamba_head_dim": 16,
              "mamba_num_groups": 2, "mamba_state_dim": 16, "attention_backend": "local",
              "add_bias_linear": False, "position_embedding_type": "rope", **model}  # fmt: skip
    return RunConfig(
        model=TransformerConfig(bf16=bf16, **fields),
        parallel=ParallelConfig(**(parallel or {})),
        gpt=GPTConfig(seq_length=32),
        optimizer=OptimizerConfig(bf16=bf16),
        data=DataConfig(vocab_size=100),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4),
    )


def megatron_hybrid_flops(*, tokens, squares, h, attention, mamba, mlp, moe=0, N, P, G, H,
                          a, g, d, f, swiglu=False, f_moe=0, f_shared=0, k=0, V,
                          latent=None, mtp=0):  # fmt: skip
    """megatron-core's num_floating_point_operations for a hybrid model (hybrid_flops and
    its mamba, attention, MLP and MoE layer functions), transcribed term by term."""
    scale = 3 / 2 if swiglu else 1
    d_in = 2 * h  # Megatron's d_in, whatever mamba_num_heads says
    heads = H if H else d_in // P
    mamba_layer = (2 * tokens * h * (2 * d_in + 2 * G * N + heads) + 7 * tokens * d_in * N
                   + 2 * tokens * d_in * h)  # fmt: skip
    p = d * a / h
    attention_layer = 4 * tokens * h * p * (h + h * (g / a)) + 2 * squares * h * p
    mlp_layer = 4 * (f / h) * scale * tokens * h**2
    if latent is None:
        routed = 4 * tokens * h * f_moe * k * scale
    else:  # routed experts at the latent width, and the up and down projections
        routed = 4 * tokens * latent * f_moe * k * scale + 4 * tokens * h * latent
    moe_layer = routed + 4 * tokens * h * f_shared * scale
    forward = (attention * attention_layer + mlp * mlp_layer + mamba * mamba_layer
               + moe * moe_layer + 2 * tokens * h * V * (1 + mtp))  # fmt: skip
    return forward * 3


def test_parameters():
    result = estimate(make_config(), world_size=1)
    # A Mamba layer: in_proj hW = 64*328 = 20992, conv1d X(K + 1) = 192*5 = 960, dt_bias,
    # A_log and D 3H = 24, the gated norm I = 128, out_proj Ih = 8192: 30296 split; its
    # LayerNorm 2h = 128 whole. The MLP layer 2hf + 128 = 32896; the attention layer
    # 2hd(a + g) + 128 = 16512; the final norm 128; the embedding 64*128 = 8192.
    assert result["num_parameters"] == 2 * 30424 + 32896 + 16512 + 128 + 8192  # 118576
    assert result["parameters_on_most_loaded_shard"] == 118576
    # At TP 2 (V = 256) a rank holds half the split parameters and the norms whole:
    # (2*30296 + 32768 + 16384 + 64*256) / 2 + 4*128 + 128.
    tp2 = estimate(make_config(parallel={"tensor_model_parallel_size": 2}), world_size=2)
    assert tp2["parameters_on_most_loaded_shard"] == 126128 / 2 + 640


def test_flops_follow_megatrons_hybrid_formula():
    config = make_config()
    # Per token: a Mamba layer 3 (2hW + 7IN + 2Ih) = 3 (41984 + 14336 + 16384) = 218112;
    # the MLP layer 6hf x 2 = 196608; the attention layer 6 (h(q + 2kv) + qs + qh) =
    # 6*18432 = 110592; the logits 6hV = 49152: 792576, times B s = 128.
    flops = estimate(config, world_size=1)["flops_per_iteration"]
    assert flops == 792576 * 128
    assert flops == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=1, mamba=2, mlp=1, N=16, P=16, G=2,
        H=8, a=4, g=4, d=16, f=256, V=128,
    )  # fmt: skip
    # MoE layers (E) count as a transformer layer's MoE MLP: top-2 of width 32 and a shared
    # expert of 48, swiglu, 6h(k f_moe + f_shared) x 3 = 6*64*112*3 = 129024 a token.
    moe = make_config(pattern="M*E-", activation="swiglu", num_moe_experts=4,
                      moe_ffn_hidden_size=32, moe_router_topk=2,
                      moe_shared_expert_intermediate_size=48)  # fmt: skip
    assert estimate(moe, world_size=1)["flops_per_iteration"] == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=1, mamba=1, mlp=1, moe=1, N=16, P=16,
        G=2, H=8, a=4, g=4, d=16, f=moe.model.ffn_hidden_size, swiglu=True, f_moe=32,
        f_shared=48, k=2, V=128,
    )  # fmt: skip


def test_latent_moe_flops_follow_megatrons_formula():
    # Nemotron 3 Super's latent MoE (L = 24): top-2 experts of width 32 at L, 6 k f_moe L x 2
    # = 18432, the projections 12 h L = 18432, a shared expert of 48, 6 h f_shared x 2 =
    # 36864: 73728 a token for the E layer.
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
               moe_shared_expert_intermediate_size=48)  # fmt: skip
    latent = make_config(pattern="M*E-", moe_latent_size=24, **moe)
    plain = make_config(pattern="M*E-", **moe)
    flops = estimate(latent, world_size=1)["flops_per_iteration"]
    # the plain layer's experts at h instead: 6 k f_moe h x 2 = 49152
    assert flops == estimate(plain, world_size=1)["flops_per_iteration"] + (
        18432 + 18432 - 49152) * 128  # fmt: skip
    assert flops == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=1, mamba=1, mlp=1, moe=1, N=16, P=16,
        G=2, H=8, a=4, g=4, d=16, f=latent.model.ffn_hidden_size, f_moe=32, f_shared=48, k=2,
        V=128, latent=24,
    )  # fmt: skip


def test_multi_token_prediction_modules_count_their_layers():
    # "M-M*/M*": one module of a Mamba and an attention layer (30424 + 16512), its three
    # LayerNorms 3*2h = 384 and eh_proj 2h*h = 8192, beside test_parameters' 118576.
    config = make_config(pattern="M-M*/M*", num_layers=4)
    result = estimate(config, world_size=1)
    assert result["num_parameters"] == 118576 + 30424 + 16512 + 384 + 8192
    # Megatron's hybrid formula counts the module's layers and its logits; mp also counts
    # eh_proj and the norms, 6 (3h + 2h^2) = 50304 a token.
    assert result["flops_per_iteration"] == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=2, mamba=3, mlp=1, N=16, P=16, G=2,
        H=8, a=4, g=4, d=16, f=256, V=128, mtp=1,
    ) + 50304 * 128  # fmt: skip
    # One module at two depths (mtp_use_repeated_layer): its weights once, its work twice.
    repeated = make_config(pattern="M-M*/M*/M*", num_layers=4, mtp_use_repeated_layer=True)
    twice = estimate(repeated, world_size=1)
    assert twice["num_parameters"] == result["num_parameters"]
    assert twice["flops_per_iteration"] == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=3, mamba=4, mlp=1, N=16, P=16, G=2,
        H=8, a=4, g=4, d=16, f=256, V=128, mtp=2,
    ) + 2 * 50304 * 128  # fmt: skip


def test_pipeline_segments_place_the_layers():
    # "M-|M*" at PP2: stage 0 a Mamba layer and the MLP, stage 1 the other Mamba layer and
    # attention; "M-M|*" puts three layers on stage 0.
    even = make_config(pattern="M-|M*", num_layers=4, parallel={"pipeline_model_parallel_size": 2})
    assert stage_layer_kinds(even, 0) == [("mamba", False), ("mlp", False)]
    uneven = make_config(pattern="M-M|*", num_layers=4,
                         parallel={"pipeline_model_parallel_size": 2})  # fmt: skip
    assert stage_layer_kinds(uneven, 0) == [("mamba", False), ("mlp", False), ("mamba", False)]
    assert stage_layer_kinds(uneven, 1) == [("attention", False)]
    # the most loaded stage: 2 Mamba layers + the MLP's + the embedding, not even's 1
    loaded = estimate(uneven, world_size=2)["parameters_on_most_loaded_shard"]
    assert loaded == estimate(even, world_size=2)["parameters_on_most_loaded_shard"] + 30424


def test_flops_take_the_mixers_own_inner_width():
    # 12 heads of 16: I = 192, not Megatron's 2h = 128. W = 384 + 64 + 12 = 460: a Mamba
    # layer 3 (2*64*460 + 7*192*16 + 2*192*64) = 3*104960 = 314880 a token.
    wide = estimate(make_config(pattern="M", mamba_num_heads=12), world_size=1)
    assert wide["flops_per_iteration"] == (314880 + 49152) * 128
    # Without mamba_num_heads the width is Megatron's 2h in heads of P: its figure.
    default = estimate(make_config(pattern="M", mamba_num_heads=None), world_size=1)
    assert default["flops_per_iteration"] == megatron_hybrid_flops(
        tokens=128, squares=4 * 32**2, h=64, attention=0, mamba=1, mlp=0, N=16, P=16, G=2,
        H=None, a=4, g=4, d=16, f=256, V=128,
    )  # fmt: skip


def test_activations_by_layer_kind():
    result = estimate(make_config(), world_size=1)
    # sbh = 32*2*64 = 4096, t = 1, no recompute, the scores 5as^2b = 40960 kept.
    # Mamba layer (X = 192, W = 328, I = 128, H = 8), 16-bit: 5 sbh = 20480 whole,
    # sb(2X + 2W + 2I) = 64*1296 = 82944 split; fp32: dt, sb 8H = 4096. 107520 in all.
    # MLP layer: 5 sbh + 4f/h sbh = 86016. Attention layer: 5 sbh + 8 sbh + 40960 = 94208.
    # Embedding 8sb + sbh = 4608; output layer 4sbh + 4sbV = 49152.
    expected = 2 * 107520 + 86016 + 94208 + 4608 + 49152  # 449024
    assert result["activation_mb"] * MB == pytest.approx(expected)
    # fp32 doubles the 16-bit terms only: dt's 2 x 4096 are fp32 already.
    fp32 = estimate(make_config(bf16=False), world_size=1)
    assert fp32["activation_mb"] * MB == pytest.approx(2 * expected - 2 * 4096)
    # TP 2 with sequence parallelism: every term / 2 (the mixers split by heads), the
    # logits 4sbV of V = 256.
    tp2 = {"tensor_model_parallel_size": 2}
    sp = estimate(make_config(sequence_parallel=True, parallel=tp2), world_size=2)
    assert sp["activation_mb"] * MB == pytest.approx((expected + 4 * 64 * 128) / 2)


def test_megatron_formula_refuses_hybrid_models():
    with pytest.raises(ValueError, match="hybrid_layer_pattern='M-M\\*' with --megatron-formula"):
        estimate(make_config(), world_size=1, megatron_formula=True)


# Megatron-LM's Nemotron-H 8B line (examples/post_training/modelopt/conf/nvidia/
# Nemotron-H-8B-Base-8K.sh), less its tokenizer and checkpoint flags, at TP 8 with
# sequence parallelism and the distributed optimizer.
NEMOTRON_H_8B = (
    "--micro-batch-size 1 --global-batch-size 8 --bf16 --no-masked-softmax-fusion "
    "--disable-bias-linear --untie-embeddings-and-output-weights "
    "--use-rotary-position-embeddings --no-rope-fusion --no-position-embedding "
    "--normalization RMSNorm --squared-relu --hidden-size 4096 --ffn-hidden-size 21504 "
    "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
    "--hybrid-layer-pattern M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- "
    "--mamba-head-dim 64 --mamba-num-heads 128 --mamba-num-groups 8 --mamba-state-dim 128 "
    "--seq-length 4096 --max-position-embeddings 8192 --make-vocab-size-divisible-by 1 "
    "--use-mcore-models --rotary-percent 0.5 --rotary-base 500000 "
    "--export-model-type HybridModel --tensor-model-parallel-size 8 --sequence-parallel "
    "--use-distributed-optimizer"
)


def test_cli_with_a_nemotron_h_command_line(capsys):
    argv = ["estimate", "--world-size", "8", "--vocab-size", "131072", *NEMOTRON_H_8B.split()]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    # 24 Mamba, 24 MLP and 4 attention layers; its FLOPs are Megatron's (I = 128 x 64 = 2h).
    assert result["flops_per_iteration"] == megatron_hybrid_flops(
        tokens=8 * 4096, squares=8 * 4096**2, h=4096, attention=4, mamba=24, mlp=24, N=128,
        P=64, G=8, H=128, a=32, g=8, d=128, f=21504, V=131072,
    )  # fmt: skip
    # Per Mamba layer 4096 x 18560 (in_proj) + 10240 x 5 (conv1d) + 3 x 128 + 8192 (the
    # gated norm) + 8192 x 4096 (out_proj) + 4096 (its norm) = 109,640,064; per MLP layer
    # 2 x 4096 x 21504 + 4096 = 176,164,864; per attention layer 2 x 4096 x 128 x 40 +
    # 4096 = 41,947,136; the final norm, the embedding and the output layer 4096 + 2 x
    # 4096 x 131072.
    assert result["num_parameters"] == (24 * 109_640_064 + 24 * 176_164_864 + 4 * 41_947_136
                                        + 4096 + 2 * 4096 * 131072)  # fmt: skip
    assert main([*argv, "--megatron-formula"]) == 2
    assert "no hybrid form" in capsys.readouterr().err
