"""`estimate` against hand-worked figures (the arithmetic is in the comments) and
published ones. Symbols as in mp_train.estimate: s sequence, b micro-batch, h hidden,
a heads, f ffn width, L layers, V padded vocabulary, t tensor-parallel size.

The base model unless a test says otherwise: L=2, h=64, a=4 (head width 16), f=4h=256,
LayerNorm, gelu, tied embeddings, s=32, b=2, vocabulary 100, bf16 with Adam; no linear
biases and rotary positions, so that the counts are Megatron's formula's (the parameters
beside it are checked against GPTModel's count at the end)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from mp_data import DataConfig
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import OptimizerConfig
from mp_state import ParallelConfig
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate, main, padded_vocab_size

MB = 2**20
CONTRACT = ("num_parameters", "weight_and_optimizer_mb", "activation_mb", "total_mb",
            "flops_per_iteration")  # fmt: skip


def make_config(
    *, seq=32, mbs=2, gbs=None, vocab=100, bf16=True, parallel=None, optimizer=None, **model
) -> RunConfig:
    # "local" attention keeps its probabilities (Megatron's 5as^2b, the whole square at
    # these short sequences), so the formulas below are Megatron's.
    fields = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "attention_backend": "local", "add_bias_linear": False,
              "position_embedding_type": "rope", **model}  # fmt: skip
    return RunConfig(
        model=TransformerConfig(bf16=bf16, **fields),
        parallel=ParallelConfig(**(parallel or {})),
        gpt=GPTConfig(seq_length=seq),
        optimizer=OptimizerConfig(bf16=bf16, **(optimizer or {})),
        data=DataConfig(vocab_size=vocab),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs),
    )


# Base model, tp=1: attention 2 h d (a + g) = 2*64*16*8 = 16384; MLP 2 h f = 32768;
# two LayerNorms (weight + bias) 2*h*2 = 256; a layer 49408; two layers plus the final
# norm 2*49408 + 128 = 98944; V = 100 padded to 128: embedding 64*128 = 8192.
BASE_BLOCK = 98944
BASE_PARAMETERS = 98944 + 8192  # 107136


def test_padded_vocab_size_follows_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304  # GPT-2's well-known padded vocabulary
    assert padded_vocab_size(50257, 128, 8) == 51200  # multiple of 1024
    assert padded_vocab_size(128, 128, 1) == 128


def test_small_dense_gpt():
    result = estimate(make_config(gbs=4), world_size=1)
    assert set(CONTRACT) <= set(result)
    assert result["num_parameters"] == BASE_PARAMETERS
    assert result["padded_vocab_size"] == 128
    # bf16 weight 2 + fp32 gradient 4 + fp32 main weight 4 + Adam 8 = 18 bytes.
    assert result["bytes_per_parameter"] == 18
    assert result["parameters_on_most_loaded_shard"] == 107136
    assert result["weight_and_optimizer_mb"] == pytest.approx(107136 * 18 / MB)  # 1928448 B
    # No recompute, t=1: sbh = 32*2*64 = 4096; per layer 10 sbh + (8 + 4f/h) sbh + 5 a s^2 b
    # = 40960 + 24*4096 + 5*4*32*32*2 = 40960 + 98304 + 40960 = 180224; two layers 360448;
    # embedding 8sb + sbh = 512 + 4096 = 4608; output layer 4sbh + 4sbV = 16384 + 32768.
    activation = 360448 + 4608 + 49152  # 414208
    assert result["activation_mb"] == pytest.approx(activation / MB)
    assert result["total_mb"] == pytest.approx((1928448 + activation) / MB)
    assert result["num_microbatches"] == 2 and result["data_parallel_size"] == 1


def test_flops_dense():
    # Per token and layer: h(q + 2kv) + q s + q h = 64*192 + 64*32 + 64*64 = 18432 (q = kv = 64);
    # MLP h f 2 = 32768; logits h V = 8192. 6 (2*18432 + 2*32768 + 8192) = 663552 per token,
    # times B s = 4*32: 84934656. Also 72 B s L h^2 (1 + s/(12h) + V/(12 L h))
    # = 72*4*32*2*4096 * (1 + 1/24 + 1/12) = 75497472 * 1.125 = 84934656.
    assert estimate(make_config(gbs=4), world_size=1)["flops_per_iteration"] == 84934656


def test_gqa():
    # a=8, g=2, head width 8, RMSNorm, fp32 (no bf16), t=2: V = 100 padded to 256.
    config = make_config(
        num_attention_heads=8, num_query_groups=2, normalization="RMSNorm", bf16=False,
        parallel={"tensor_model_parallel_size": 2},
    )  # fmt: skip
    result = estimate(config, world_size=2)
    # Attention 2*64*8*(8 + 2) = 10240; MLP 32768; norms 2*64*1 = 128; layer 43136;
    # block 2*43136 + 64 = 86336; embedding 64*256 = 16384.
    assert result["num_parameters"] == 86336 + 16384  # 102720
    # A rank holds half the weights, (2*(10240 + 32768) + 16384) / 2 = 51200, and the
    # norms whole, 2*128 + 64 = 320 (every tensor-parallel rank holds them).
    assert result["parameters_on_most_loaded_shard"] == 51200 + 320  # 51520
    # fp32 weight 4 + gradient 4 + Adam 8, no main copy.
    assert result["bytes_per_parameter"] == 16
    assert result["weight_and_optimizer_mb"] == pytest.approx(51520 * 16 / MB)
    # No SP, no recompute, t=2: 10 sbh + (24 sbh + 5 a s^2 b)/2 = 40960 + (98304 + 81920)/2
    # = 131072 per layer; embedding 4608 (whole); output 4sbh + 4sbV/2 = 16384 + 32768.
    # The formula counts 16-bit activations: fp32 keeps twice as many bytes.
    activation = 2 * 131072 + 4608 + 49152  # 315904
    assert result["activation_mb"] == pytest.approx(2 * activation / MB)


def test_flops_gqa():
    config = make_config(
        num_attention_heads=8, num_query_groups=2, parallel={"tensor_model_parallel_size": 2}
    )
    # B = b x dp = 2. q = 64, kv = 2*8 = 16: attention 64*(64 + 32) + 64*32 + 64*64 = 12288;
    # MLP 32768; logits 64*256 = 16384. 6 (2*12288 + 2*32768 + 16384) = 638976 per token,
    # times B s = 64: 40894464.
    assert estimate(config, world_size=2)["flops_per_iteration"] == 40894464


def test_swiglu():
    # Megatron's default f for swiglu: int(4*64*2/3/64)*64 = 128. s=16, b=1, V=128.
    config = make_config(activation="swiglu", seq=16, mbs=1, vocab=128)
    assert config.model.ffn_hidden_size == 128
    result = estimate(config, world_size=1)
    # MLP 3 h f = 3*64*128 = 24576 (Megatron's 3/2 factor); layer 16384 + 24576 + 256 = 41216;
    # block 2*41216 + 128 = 82560; embedding 8192.
    assert result["num_parameters"] == 82560 + 8192  # 90752
    # Activations take f as is (Megatron's 4f/h, not widened for the gate): sbh = 1024;
    # layer 10*1024 + (8 + 8)*1024 + 5*4*16*16*1 = 10240 + 16384 + 5120 = 31744;
    # embedding 8*16 + 1024 = 1152; output 4*1024 + 4*16*128 = 12288.
    assert result["activation_mb"] == pytest.approx((2 * 31744 + 1152 + 12288) / MB)


def test_flops_swiglu():
    config = make_config(activation="swiglu", seq=16, mbs=1, vocab=128)
    # q = kv = 64: attention 64*192 + 64*16 + 64*64 = 17408; MLP h f 3 = 24576; logits 8192.
    # 6 (2*17408 + 2*24576 + 8192) = 552960 per token, times B s = 16: 8847360.
    assert estimate(config, world_size=1)["flops_per_iteration"] == 8847360


def test_untied_embeddings():
    untied = {"untie_embeddings_and_output_weights": True}
    # t=2: V = 256, embedding 64*256 = 16384, two of them.
    one_stage = estimate(
        make_config(parallel={"tensor_model_parallel_size": 2}, **untied), world_size=2
    )
    assert one_stage["num_parameters"] == BASE_BLOCK + 2 * 16384  # 131712
    # pp = 1: the layers' weights 2*49152, the embedding and the output layer over t,
    # the LayerNorms (2*256 + 128) whole: (98304 + 2*16384) / 2 + 640.
    assert one_stage["parameters_on_most_loaded_shard"] == 65536 + 640
    pp2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    two_stages = estimate(make_config(gbs=4, parallel=pp2, **untied), world_size=4)
    # pp = 2: the first stage holds layer 0 and the input embedding: (49152 + 16384) / 2
    # + 256; the last stage, layer 1, the final norm and the output layer, 128 more, but
    # one micro-batch's activations to the first stage's two (m = 2): the first is the
    # most loaded.
    assert two_stages["pipeline_stage"] == 0
    assert two_stages["parameters_on_most_loaded_shard"] == 32768 + 256  # 33024
    # With one micro-batch the first stage keeps one too: the last is the most loaded.
    one_microbatch = estimate(make_config(gbs=2, parallel=pp2, **untied), world_size=4)
    assert one_microbatch["pipeline_stage"] == 1
    assert one_microbatch["parameters_on_most_loaded_shard"] == 32768 + 256 + 128


def test_distributed_optimizer():
    config = make_config(gbs=8, optimizer={"use_distributed_optimizer": True})
    result = estimate(config, world_size=4)
    # dp = 4: 6 + 12/4 = 9 bytes per parameter (Megatron's), 107136 on the shard.
    assert result["bytes_per_parameter"] == 9
    assert result["weight_and_optimizer_mb"] == pytest.approx(107136 * 9 / MB)
    # fp32: weight 4 + gradient 4 unsharded, Adam 8 sharded: 4 + 4 + 8/4 = 10.
    fp32 = make_config(gbs=8, bf16=False, optimizer={"use_distributed_optimizer": True})
    assert estimate(fp32, world_size=4)["bytes_per_parameter"] == 10
    # Context parallel ranks share the optimizer state too: dp x cp = 4 x 2: 6 + 12/8.
    with_cp = make_config(
        gbs=8, optimizer={"use_distributed_optimizer": True},
        parallel={"context_parallel_size": 2}, attention_dropout=0.0,
    )  # fmt: skip
    assert estimate(with_cp, world_size=8)["bytes_per_parameter"] == 7.5
    # Two distributed-optimizer instances: the state shards over half of them, 6 + 12/2.
    halves = make_config(
        gbs=8, optimizer={"use_distributed_optimizer": True},
        parallel={"num_distributed_optimizer_instances": 2},
    )  # fmt: skip
    assert estimate(halves, world_size=4)["bytes_per_parameter"] == 12
    # ZeRO-2/3: fp32 rows (the main parameters), fp32 gradients and Adam, all over dp:
    # 16 / 4 (docs/fsdp.md measured 4 bytes per parameter at DP4), and with two instances
    # (hybrid sharding) over the slice of 2.
    for strategy in ("optim_grads", "optim_grads_params"):
        zero = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": strategy}
        for instances, want in ((1, 4), (2, 8)):
            sliced = {"num_distributed_optimizer_instances": instances}
            config = make_config(gbs=8, optimizer=zero, parallel=sliced)
            assert estimate(config, world_size=4)["bytes_per_parameter"] == want
    # The precision-aware optimizer's bf16 moments: 6 + (4 + 2 + 2)/4 = 8; bf16 main
    # gradients too: 2 + 2 + 8/4 = 6.
    aware = {"use_distributed_optimizer": True, "use_precision_aware_optimizer": True,
             "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}  # fmt: skip
    assert estimate(make_config(gbs=8, optimizer=aware), world_size=4)["bytes_per_parameter"] == 8
    bf16_grads = make_config(gbs=8, optimizer=aware | {"main_grads_dtype": "bf16"})
    assert estimate(bf16_grads, world_size=4)["bytes_per_parameter"] == 6


def test_context_parallel_splits_the_sequence():
    config = make_config(gbs=8, parallel={"context_parallel_size": 2}, cp_comm_type="a2a",
                         attention_dropout=0.0)  # fmt: skip
    result = estimate(config, world_size=8)
    # c=2: 16 of the 32 tokens per rank, sbh = 16*2*64 = 2048; all-to-all attends over the
    # whole sequence with a/c heads, keeping (a/c) s^2 b probabilities, 2 bytes each without
    # dropout: layer 10*2048 + 24*2048 + 2*2*32*32*2 = 20480 + 49152 + 8192 = 77824;
    # embedding 8*16*2 + 2048 = 2304; output 4*2048 + 4*16*2*128 = 8192 + 16384 = 24576.
    assert result["activation_mb"] * MB == pytest.approx(2 * 77824 + 2304 + 24576)
    assert result["data_parallel_size"] == 4
    # FLOPs count the whole global batch whatever the layout: B = 8, twice test_flops_dense.
    assert result["flops_per_iteration"] == 2 * 84934656
    # The ring (and all-gather) blocks keep no probabilities: the score term goes.
    ring = make_config(gbs=8, parallel={"context_parallel_size": 2}, attention_dropout=0.0)
    assert estimate(ring, world_size=8)["activation_mb"] * MB == pytest.approx(
        2 * (77824 - 8192) + 2304 + 24576
    )


def test_the_chunked_output_loss_counts_one_chunk_of_logits():
    whole = estimate(make_config(), world_size=1)["activation_mb"] * MB
    chunked = estimate(make_config(output_loss_chunk_tokens=16), world_size=1)
    # s b = 64 tokens, V = 128: the logits term 4 s b V = 32768 becomes 4 c V = 8192.
    assert whole - chunked["activation_mb"] * MB == pytest.approx(32768 - 8192)
    larger = estimate(make_config(output_loss_chunk_tokens=1000), world_size=1)
    assert larger["activation_mb"] * MB == pytest.approx(whole)  # one chunk: all 64 tokens
    # FLOPs stay the model's: the backward's recomputed GEMM is not counted (as recompute).
    assert chunked["flops_per_iteration"] == estimate(make_config(), 1)["flops_per_iteration"]


def test_the_score_term_follows_the_core_attention():
    # Megatron's 5as^2b is kept only where the core attention keeps its probabilities.
    def activation(seq, device_type="cuda", **model):
        config = make_config(seq=seq, mbs=1, **model)
        return estimate(config, world_size=1, device_type=device_type)["activation_mb"] * MB

    flash = activation(32, attention_backend="flash")
    assert activation(32) - flash == pytest.approx(2 * 5 * 4 * 32 * 32)  # local: two layers
    # "auto": SDPA (none kept) on CUDA; the blocked attention on a CPU while its
    # probabilities fit the limit (here the whole square: one block), SDPA beyond.
    assert activation(32, attention_backend="auto") == pytest.approx(flash)
    assert activation(32, "cpu", attention_backend="auto") == pytest.approx(activation(32))
    # bf16 at 8192 positions: 4 heads x 256^2 x 528 blocks x 2 bytes = 277 MB > 128 MiB.
    long_flash = activation(8192, attention_backend="flash")
    assert activation(8192, "cpu", attention_backend="auto") == pytest.approx(long_flash)
    # Beyond one block of 256 rows, blocked attention keeps the causal blocks only:
    # rows [256 i, 256 (i + 1)) see 256 (i + 1) keys; 2 bytes each without dropout.
    kept = sum(256 * 256 * (i + 1) for i in range(4096 // 256))
    local = activation(4096, attention_dropout=0.0)
    assert local - activation(4096, attention_backend="flash", attention_dropout=0.0) == (
        pytest.approx(2 * 2 * 4 * kept)
    )
    with pytest.raises(ValueError, match="device_type='tpu' must be cuda or cpu"):
        estimate(make_config(), world_size=1, device_type="tpu")


def _activation(**model) -> float:
    config = make_config(parallel={"tensor_model_parallel_size": 2}, **model)
    return estimate(config, world_size=2)["activation_mb"] * MB


def test_activation_sequence_parallel_and_selective_recompute():
    # t=2, V=256, sbh = 4096, f/h = 4, the scores 5 a s^2 b = 40960.
    # Megatron's form: (sbh(18 + 4f/h) L + 8sb + sbh + 4sbh(1 + V/h)) / t
    # = (34*4096*2 + 512 + 4096 + 4*4096*5) / 2 = (278528 + 4608 + 81920)/2 = 182528.
    assert _activation(sequence_parallel=True, recompute_granularity="selective") == (
        pytest.approx(182528)
    )
    # Sequence parallel, no recompute: every term / t, the scores kept:
    # layer (34*4096 + 40960)/2 = 90112; embedding 4608/2; output 81920/2.
    assert _activation(sequence_parallel=True) == pytest.approx(2 * 90112 + 2304 + 40960)
    # Selective without SP: sbh(10 + 24/t) = 4096*22 = 90112 a layer; embedding 4608 whole;
    # output 4sbh whole + 4sbV/t = 16384 + 65536/2.
    assert _activation(recompute_granularity="selective") == pytest.approx(2 * 90112 + 4608 + 49152)
    # Neither: sbh(10 + 24/t) + 5as^2b/t = 90112 + 20480 = 110592 a layer.
    assert _activation() == pytest.approx(2 * 110592 + 4608 + 49152)


def test_activation_full_recompute():
    # t=1, the base model: a full layer stores 180224; a checkpoint 2 sbh = 8192.
    # uniform, 1 layer per group: 2 checkpoints + one layer recomputed during backward.
    uniform = make_config(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    expected = 2 * 8192 + 4608 + 49152 + 180224  # 250368
    assert estimate(uniform, world_size=1)["activation_mb"] * MB == pytest.approx(expected)
    # block, 1 layer: the first layer checkpointed, the second stored whole, + one recomputed.
    block = make_config(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    )
    expected = 8192 + 180224 + 4608 + 49152 + 180224  # 422400
    assert estimate(block, world_size=1)["activation_mb"] * MB == pytest.approx(expected)


def test_full_recompute_with_a_chunk_of_the_embedding_or_the_loss_alone():
    # L=4, t=2 + SP, p=2, the embedding and the loss counted as layers: 6 over v=3 chunks
    # a stage, one each. Stage 0's chunks hold 0 (the embedding), 1 and 1 layers, stage
    # 1's 1, 1 and 0 (the loss); the recompute groups are counted chunk by chunk.
    parallel = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": 3,
                "account_for_embedding_in_pipeline_split": True,
                "account_for_loss_in_pipeline_split": True}  # fmt: skip
    for method in ("uniform", "block"):  # one layer a chunk: either keeps its input
        config = make_config(gbs=4, parallel=parallel, num_layers=4, sequence_parallel=True,
                             recompute_granularity="full", recompute_method=method,
                             recompute_num_layers=1)  # fmt: skip
        result = estimate(config, world_size=4)
        # A layer keeps its input 2 sbh / t = 4096; the layer recomputed in backward stores
        # (10 sbh + 24 sbh + 5 a s^2 b) / t = (139264 + 40960) / 2 = 90112. The last stage:
        # 2 layers over 3 chunks, (v - 1) p + 1 = 5 chunks in flight: 4096 * 2/3 * 5 =
        # 13653.3; the output layer (4sbh + 4sbV) / t = 40960: 144725.3 in all. (The first:
        # (2 * 4096 * 2 + 4608) * (1 + 1/6) + 90112 = 114602.7.)
        assert result["pipeline_stage"] == 1
        assert result["activation_mb"] * MB == pytest.approx(4096 * 2 / 3 * 5 + 40960 + 90112)


def test_interleaved_pipeline_penalty():
    # L=4, t=2, p=2, v=2, dp=1, B=4: m = 2; sequence parallel + selective; V = 256.
    parallel = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    common = {"num_layers": 4, "sequence_parallel": True, "recompute_granularity": "selective"}
    interleaved = {**parallel, "virtual_pipeline_model_parallel_size": 2}
    result = estimate(make_config(gbs=4, parallel=interleaved, **common), world_size=4)
    # (34 sbh L + (8sb + sbh) p) = 34*4096*4 + 4608*2 = 557056 + 9216 = 566272;
    # x (1 + (p-1)/(p v)) = 1.25: 707840; / t: 353920. No output layer (p > 1).
    assert result["activation_mb"] * MB == pytest.approx(353920)
    # The first stage holds layers 0 and 2 (2*49152 / 2 + 2*256 for the norms, whole) and
    # the embedding 256*64 / 2: 49152 + 512 + 8192 = 57856.
    assert result["parameters_on_most_loaded_shard"] == 57856
    assert result["weight_and_optimizer_mb"] == pytest.approx(57856 * 18 / MB)
    # The last stage keeps (v - 1) p + 1 = 3 micro-batches of its chunks of one layer,
    # 3 x 34 sbh / t = 208896, and the output layer's (4sbh + 4sbV) / t = 40960: less.
    assert result["pipeline_stage"] == 0
    # 1F1B, m = 2 >= p: 566272 / 2 = 283136 (the last stage: 2 layers of one micro-batch
    # and the output layer, 139264 + 40960 = 180224).
    one_f_one_b = estimate(make_config(gbs=4, parallel=parallel, **common), world_size=4)
    assert one_f_one_b["activation_mb"] * MB == pytest.approx(283136)
    # With m = 1 < p the first stage's x 1/2 gives 141568: the last stage, 180224, holds more.
    one_microbatch = estimate(make_config(gbs=2, parallel=parallel, **common), world_size=4)
    assert one_microbatch["pipeline_stage"] == 1
    assert one_microbatch["activation_mb"] * MB == pytest.approx(180224)


# The MoE model of the MoE tests: 4 routed experts of width 64, top-2, a shared expert of
# width 32, layer 0 MoE and layer 1 dense (moe_layer_freq 2), expert parallel 2
# (add_bias_linear=False: a shared expert has no biases).
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64,
       "moe_shared_expert_intermediate_size": 32, "moe_layer_freq": 2,
       "add_bias_linear": False}  # fmt: skip
EP2 = {"expert_model_parallel_size": 2}


def test_moe():
    config = make_config(gbs=4, optimizer={"use_distributed_optimizer": True}, parallel=EP2,
                         **MOE)  # fmt: skip
    result = estimate(config, world_size=2)
    # MoE layer: attention 16384 + shared expert 2*64*32 = 4096 + norms 256 = 20736, and
    # experts 2*64*64*4 = 32768 (Megatron: 2h(64*4 + 32 + 2) + 16384 = 53504 = 20736 + 32768);
    # dense layer 49408; block 20736 + 32768 + 49408 + 128 = 103040; embedding 8192.
    # Megatron leaves the router out; mp counts its h x E = 64*4 = 256 weights per MoE
    # layer (trained, saved and held by the optimizer like any other): 103296.
    assert result["num_parameters"] == 103040 + 256 + 8192  # 111488
    # A token passes through 2 of the 4 experts: 111488 - 32768 / 2.
    assert result["num_active_parameters"] == 111488 - 16384
    # dp = 2, e = 2: dense shard 103296 - 32768 + 8192 = 78720; experts 32768 / e = 16384.
    assert result["parameters_on_most_loaded_shard"] == 78720
    assert result["expert_parameters_on_most_loaded_shard"] == 16384
    # Distributed optimizer: dense 6 + 12/2 = 12 bytes; experts (expert dp = 2/2 = 1) 18.
    assert result["weight_and_optimizer_mb"] == pytest.approx((78720 * 12 + 16384 * 18) / MB)
    # Activations: f averaged over the layers, (256 + (2*64 + 32)) / 2 = 208;
    # layer 10 sbh + (8 + 4*208/64) sbh + scores = 40960 + 21*4096 + 40960 = 167936.
    assert result["activation_mb"] * MB == pytest.approx(2 * 167936 + 4608 + 49152)


def test_moe_shared_expert_gate_and_layer_list():
    # The shared expert's gate adds its h = 64 weights per MoE layer; moe_layer_freq as a
    # list [1, 0] is the same layout as 2.
    gated = {**MOE, "moe_shared_expert_gate": True, "moe_layer_freq": [1, 0]}
    result = estimate(make_config(gbs=4, parallel=EP2, **gated), world_size=2)
    assert result["num_parameters"] == 111488 + 64
    # Every layer MoE (moe_layer_freq 1): layer 1 becomes a MoE layer like layer 0, 20736 +
    # 256 + 32768 = 53760 for 49408: 111488 + 4352.
    every = {**MOE, "moe_layer_freq": 1}
    result = estimate(make_config(gbs=4, parallel=EP2, **every), world_size=2)
    assert result["num_parameters"] == 111488 + 4352


def test_moe_expert_tensor_parallel():
    # t = 2 with sequence parallelism, e = 2, expert-t 1: the 4 dense x data ranks of a
    # stage (world 4, dp 2) hold the experts as e 2 x expert-dp 2; V = 256.
    parallel = {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1, **EP2}
    config = make_config(gbs=4, parallel=parallel, sequence_parallel=True,
                         optimizer={"use_distributed_optimizer": True}, **MOE)  # fmt: skip
    result = estimate(config, world_size=4)
    # Routed experts 32768 over e x expert-t = 2: 16384. Over t: attention 2*16384, the
    # shared expert 4096, the dense MLP 32768 and the embedding 64*256: 86016 / 2 = 43008;
    # whole on each rank: the norms 3*256 + 64*2 and the router 256: 896.
    assert result["expert_parameters_on_most_loaded_shard"] == 16384
    assert result["parameters_on_most_loaded_shard"] == 43008 + 896  # 43904
    # Dense 6 + 12/2 = 12 bytes, experts 6 + 12/2 (expert dp 2) = 12.
    assert result["weight_and_optimizer_mb"] == pytest.approx((43904 + 16384) * 12 / MB)
    expert_tp = estimate(make_config(gbs=4, sequence_parallel=True, **MOE,
                                     parallel={**parallel, "expert_tensor_parallel_size": 2}),
                         world_size=4)  # fmt: skip
    assert expert_tp["expert_parameters_on_most_loaded_shard"] == 8192


# gpt-oss's shape: RMSNorm, GQA (a = 4, g = 2, d = 16), rope, untied, the clamped quick
# GEGLU and biases everywhere, every layer MoE (4 experts of width 32, top-2, no shared).
GPT_OSS = {"normalization": "RMSNorm", "num_query_groups": 2, "kv_channels": 16,
           "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
           "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
           "add_bias_linear": True, "num_moe_experts": 4, "moe_ffn_hidden_size": 32,
           "moe_router_topk": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip


def test_gpt_oss_shaped_moe_counts_the_models_parameters():
    config = make_config(bf16=False, **GPT_OSS)
    result = estimate(config, world_size=1)
    # Per layer: attention 2*64*16*(4 + 2) = 12288 and its biases, QKV (4 + 2*2)*16 = 128
    # and projection 64; norms 2*64 = 128, router 64*4 + 4 = 260, experts
    # 4*(64*32*3 + 2*32 + 64) = 4*6272 = 25088: 37956. Two layers and the final norm
    # 75976; embedding and output layer 2*64*128 = 16384.
    assert result["num_parameters"] == 75976 + 16384  # 92360
    # A token passes through 2 of the 4 experts: 92360 - 2*25088/2.
    assert result["num_active_parameters"] == 92360 - 25088
    model = GPTModel(config.model, "local", result["padded_vocab_size"], config.gpt.seq_length,
                     groups=ModelGroups.single())  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) == result["num_parameters"]
    # FLOPs: attention 64*(64 + 64) + 64*32 + 64*64 = 14336 a layer; the gated experts
    # 2*32*3 = 192 wide per layer; logits 64*128. 6 (2*14336 + 64*384 + 8192) = 368640 per
    # token, times B s = 2*32: 23592960.
    assert result["flops_per_iteration"] == 23592960


def test_flops_moe():
    config = make_config(gbs=4, parallel=EP2, **MOE)
    # Attention 2*18432 = 36864; MLP widths: dense 256*2, MoE (2*64 + 32)*2 = 320, so
    # h*832 = 53248; logits 8192. 6*98304 = 589824 per token, times B s = 128: 75497472.
    # The router's 6hE per token is left out, as in Megatron.
    assert estimate(config, world_size=2)["flops_per_iteration"] == 75497472


def test_gpt3_175b_against_published_figures():
    config = make_config(
        num_layers=96, hidden_size=12288, num_attention_heads=96, seq=2048, mbs=1, gbs=1536,
        vocab=50257, parallel={"tensor_model_parallel_size": 8},
    )  # fmt: skip
    result = estimate(config, world_size=8)
    # Brown et al. 2020, Table 2.1: 175.0B. Megatron's count leaves out biases and the
    # position embeddings (about 0.03B): 174.58B, within 0.5%.
    assert result["num_parameters"] == pytest.approx(175.0e9, rel=5e-3)
    # Narayanan et al. 2021 (Megatron-LM, section 5.1) without recomputation:
    # 72 B s L h^2 (1 + s/(6h) + V/(12 L h)). Megatron now counts half of QK^T and of its
    # product with V (the causal mask), s/(12h) for s/(6h): 1.35% less here, within 1.5%.
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    published = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert result["flops_per_iteration"] == pytest.approx(published, rel=1.5e-2)
    assert result["flops_per_iteration"] == pytest.approx(
        72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h)), rel=1e-12
    )


def test_multi_token_prediction():
    # One MTP module on the base model: enorm, hnorm and its final LayerNorm 3*2*64 = 384,
    # eh_proj 2h x h = 8192 and a layer like the last (dense) 49408: 57984.
    config = make_config(gbs=4, mtp_num_layers=1)
    result = estimate(config, world_size=1)
    assert result["num_parameters"] == BASE_PARAMETERS + 57984  # 165120
    assert result["parameters_on_most_loaded_shard"] == 165120
    # Activations: test_small_dense_gpt's 414208, and the module's layer 180224, its norms'
    # and eh_proj's inputs 8 sbh = 32768 and its own output layer's 4sbh + 4sbV = 49152.
    assert result["activation_mb"] * MB == pytest.approx(414208 + 180224 + 32768 + 49152)
    # FLOPs per token (Megatron's): test_flops_dense's 663552, and the module's layer
    # 6 (18432 + 32768), norms and eh_proj 6 (3h + 2h^2) = 6*8384, logits 6hV = 6*8192:
    # 6*67776 = 406656; 1070208 per token, times B s = 128.
    assert result["flops_per_iteration"] == 1070208 * 128
    # Two stages, untied: the last holds layer 1, the final norm, the output layer, the
    # module and a copy of the embedding it embeds with: 49408 + 128 + 8192 + 57984 + 8192
    # = 123904 (the first: layer 0 and the embedding, 57600); its activations, one
    # micro-batch of layer 1 (180224), the output layer's 49152 and the module's 262144,
    # are more than the first stage's two micro-batches of layer 0, 2*(180224 + 4608).
    two_stages = make_config(gbs=4, mtp_num_layers=1, untie_embeddings_and_output_weights=True,
                             parallel={"pipeline_model_parallel_size": 2})  # fmt: skip
    result = estimate(two_stages, world_size=2)
    assert result["pipeline_stage"] == 1
    assert result["parameters_on_most_loaded_shard"] == 123904
    assert result["activation_mb"] * MB == pytest.approx(180224 + 49152 + 262144)


def test_flops_mla():
    config = make_config(multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32,
                         qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)  # fmt: skip
    # Megatron's MLA terms, r_q = 48, r = 32, dn = 16, dr = 8, dv = 16, a = 4: queries
    # 48 (64 + 4*24 + 1) = 7728; keys and values 32 (64 + 4*32 + 1) = 6176; the rotated key
    # 64*8 = 512; output 4*16*64 = 4096; QK^T and (QK^T)V at half 32 (4*24 + 4*16) / 2 = 2560:
    # attention 21072. MLP 32768, logits 64*128 = 8192. 6 (2*21072 + 2*32768 + 8192) =
    # 695232 per token, times B s = 64: 44494848.
    assert estimate(config, world_size=1)["flops_per_iteration"] == 44494848


def test_deepseek_v3_against_published_figures():
    config = make_config(
        num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, normalization="RMSNorm",
        activation="swiglu", untie_embeddings_and_output_weights=True, num_moe_experts=256,
        moe_ffn_hidden_size=2048, moe_router_topk=8, moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=[0] * 3 + [1] * 58, seq=4096, mbs=1, vocab=129280,
    )  # fmt: skip
    result = estimate(config, world_size=1)
    # DeepSeek-V3 technical report (DeepSeek-AI 2024), abstract: 671B total parameters, 37B
    # activated for each token (the multi-token prediction module's 14B apart).
    assert result["num_parameters"] == pytest.approx(671e9, rel=1e-3)
    assert result["num_active_parameters"] == pytest.approx(37e9, rel=2e-2)


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match="vocab_size"):
        estimate(make_config(vocab=None), world_size=1)
    assert estimate(make_config(vocab=None), world_size=1, vocab_size=100)["padded_vocab_size"]
    with pytest.raises(ValueError, match="world size 3"):
        estimate(make_config(parallel={"tensor_model_parallel_size": 2}), world_size=3)
    with pytest.raises(ValueError, match="global_batch_size=3"):
        estimate(make_config(gbs=3), world_size=1)
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 does not divide "
                                         "num_moe_experts=4"):  # fmt: skip
        estimate(make_config(parallel={"expert_model_parallel_size": 3}, **MOE), world_size=3)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs num_moe_experts"):
        estimate(make_config(parallel=EP2), world_size=2)
    # a training run's rule, as validate's (a MoE model at tp 2 generates without it)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 needs sequence_par"):
        estimate(make_config(parallel={"tensor_model_parallel_size": 2}, **MOE), world_size=2)


def _stub_parse_config(monkeypatch, config: RunConfig) -> list[list[str]]:
    seen: list[list[str]] = []
    module = types.ModuleType("mp_train.configuration.arguments")

    def parse_config(argv, **_):
        seen.append(list(argv))
        return config

    module.parse_config = parse_config
    monkeypatch.setitem(sys.modules, "mp_train.configuration.arguments", module)
    return seen


def test_cli_prints_one_json_object(monkeypatch, capsys):
    seen = _stub_parse_config(monkeypatch, make_config(gbs=4, vocab=None))
    argv = ["estimate", "--num-layers", "2", "--world-size", "1", "--vocab-size", "100",
            "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert set(CONTRACT) <= set(result)
    assert seen == [["--num-layers", "2"]]  # the estimate's own flags are taken out
    assert result["num_parameters"] == BASE_PARAMETERS


def test_cli_reports_bad_settings(monkeypatch, capsys):
    _stub_parse_config(monkeypatch, make_config(vocab=None))
    assert main(["estimate", "--world-size", "1"]) == 2
    assert "vocab_size" in capsys.readouterr().err
    assert main(["train"]) == 2
    monkeypatch.delitem(sys.modules, "mp_train.configuration.arguments")
    assert main(["estimate", "--config", "/nonexistent/run.yaml", "--world-size", "1"]) == 2
    assert "/nonexistent/run.yaml" in capsys.readouterr().err


def test_cli_with_the_run_arguments(capsys):
    pytest.importorskip("mp_train.configuration.arguments")
    argv = ["estimate", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--bf16", "--world-size", "1", "--vocab-size", "100", "--disable-bias-linear",
            "--position-embedding-type", "rope"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_parameters"] == BASE_PARAMETERS
    assert result["flops_per_iteration"] == 84934656
    assert result["weight_and_optimizer_mb"] == pytest.approx(107136 * 18 / MB)


def test_cli_moe_from_the_run_arguments(capsys):
    # The MoE of test_moe, given by the model's own options (top-2 by default, layer 0
    # MoE) and the run's expert-parallel size: the same totals.
    argv = ["estimate", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--bf16", "--attention-backend", "local", "--world-size", "2", "--vocab-size",
            "100", "--num-moe-experts", "4", "--moe-ffn-hidden-size", "64",
            "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "1", "0",
            "--disable-bias-linear", "--position-embedding-type", "rope",
            "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_parameters"] == 111488
    assert result["flops_per_iteration"] == 75497472
    assert result["weight_and_optimizer_mb"] == pytest.approx((78720 * 12 + 16384 * 18) / MB)
    assert result["activation_mb"] * MB == pytest.approx(2 * 167936 + 4608 + 49152)
    # Megatron's --num-experts names the same field.
    alias = [("--num-experts" if word == "--num-moe-experts" else word) for word in argv]
    assert main(alias) == 0
    assert json.loads(capsys.readouterr().out) == result
    # An expert layout that does not fit is reported, not run.
    assert main([*argv, "--expert-model-parallel-size", "3", "--world-size", "3"]) == 2
    assert "expert_model_parallel_size=3 does not divide num_moe_experts=4" in (
        capsys.readouterr().err
    )
