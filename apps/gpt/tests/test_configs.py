"""The shipped configs parse, validate at the world size they are written for, and
`mp_train.estimate` gives for them what hand arithmetic gives; docs/configuration.md
is what ci/gen_config_docs.py generates.

Symbols as in mp_train.estimate: s sequence, b micro-batch, h hidden, a heads, g query
groups, d head width, f ffn width, L layers, V padded vocabulary, t/p tensor/pipeline
sizes, B global batch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mp_train import estimate, parse_config, validate

APP = Path(__file__).resolve().parents[1]
ROOT = APP.parents[1]
ENVIRON = {
    "DATA_PATH": "/data/web/web_text_document",
    "VOCAB_FILE": "/tokenizers/gpt2/vocab.json",
    "MERGE_FILE": "/tokenizers/gpt2/merges.txt",
    "TOKENIZER_MODEL": "/tokenizers/llama-3/tokenizer.json",
    "RUN_DIR": "/runs/test",
}
MB = 2**20

# config file -> (world size it is written for, its tokenizer's vocabulary,
#                 data-parallel size, micro-batches per iteration)
CONFIGS = {
    "tiny.yaml": (2, 4096, 2, 2),
    "tiny-moe.yaml": (2, 4096, 2, 2),
    "gpt2-125m.yaml": (8, 50257, 8, 8),
    "llama-1b.yaml": (16, 128256, 8, 32),
    "llama-8b.yaml": (64, 128256, 8, 16),
    "mixtral-8x7b.yaml": (64, 32000, 8, 32),
}


def load(name: str):
    environ = {**ENVIRON, "MP_RUN_DIR": "/runs/quickstart"}
    return parse_config(["--config", str(APP / "configs" / name)], environ=environ)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_parses_and_validates_at_its_world_size(name):
    world, vocab, dp, microbatches = CONFIGS[name]
    config = load(name)
    sizes = validate(config, world)
    assert sizes["data_parallel_size"] == dp
    assert sizes["num_microbatches"] == microbatches
    # The precision is the same everywhere it lives (--bf16's rule).
    assert config.model.bf16 == config.optimizer.bf16
    assert config.model.params_dtype == config.optimizer.params_dtype
    result = estimate(config, world, vocab_size=vocab)
    assert result["data_parallel_size"] == dp
    assert result["num_microbatches"] == microbatches


def test_environment_references_are_substituted():
    gpt2 = load("gpt2-125m.yaml")
    assert gpt2.data.data_path == ["/data/web/web_text_document"]
    assert gpt2.data.vocab_file == "/tokenizers/gpt2/vocab.json"
    assert gpt2.data.merge_file == "/tokenizers/gpt2/merges.txt"
    assert gpt2.checkpoint.save == "/runs/test/checkpoints"
    llama = load("llama-8b.yaml")
    assert llama.data.tokenizer_type == "HuggingFaceTokenizer"
    assert llama.data.tokenizer_model == "/tokenizers/llama-3/tokenizer.json"


def test_a_missing_environment_variable_names_it():
    environ = {k: v for k, v in ENVIRON.items() if k != "TOKENIZER_MODEL"}
    with pytest.raises(ValueError, match="TOKENIZER_MODEL is not set"):
        parse_config(["--config", str(APP / "configs" / "llama-8b.yaml")], environ=environ)


def test_gpt2_125m_shape():
    config = load("gpt2-125m.yaml")
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (12, 768, 12)
    assert model.position_embedding_type == "learned_absolute"
    assert model.normalization == "LayerNorm" and model.activation == "gelu"
    assert not model.untie_embeddings_and_output_weights
    assert config.gpt.seq_length == config.gpt.max_position_embeddings == 1024
    result = estimate(config, 8, vocab_size=50257)
    # V: 50,257 padded to a multiple of 128 = 50,304. Per layer: attention 2hd(a + g) =
    # 2*768*64*24 = 2,359,296; MLP 2hf = 2*768*3072 = 4,718,592; two LayerNorms 2*2h =
    # 3,072; 7,080,960 x 12 = 84,971,520, plus the final LayerNorm 1,536 = 84,973,056;
    # the tied embedding hV = 768*50,304 = 38,633,472: Megatron's formula, 123,606,528.
    # Beside it the model holds the biases, QKV 3h + projection h + fc1 f + fc2 h = 6,912
    # x 12 = 82,944, and the learned positions 1,024*768 = 786,432: 124,475,904 (GPT-2's
    # 124,439,808 with 47 more padded vocabulary rows).
    assert result["padded_vocab_size"] == 50304
    assert result["num_parameters"] == 124_475_904


def test_llama_1b_parameters_match_llama_3_2_1b():
    result = estimate(load("llama-1b.yaml"), 16, vocab_size=128256)
    # Per layer: attention 2hd(a + g) = 2*2048*64*40 = 10,485,760; MLP 3hf =
    # 3*2048*8192 = 50,331,648; two RMSNorms 2h = 4,096; 60,821,504 x 16 = 973,144,064,
    # plus the final norm 2,048 = 973,146,112; the tied embedding 2048*128,256 =
    # 262,668,288. Total 1,235,814,400, Llama-3.2-1B's count.
    assert result["padded_vocab_size"] == 128256
    assert result["num_parameters"] == 1_235_814_400


def test_llama_8b_estimate_by_hand():
    config = load("llama-8b.yaml")
    result = estimate(config, 64, vocab_size=128256)
    h, a, g, d, f, L, V, s, t, p = 4096, 32, 8, 128, 14336, 32, 128256, 8192, 4, 2

    # Parameters. Per layer: attention 2hd(a + g) = 2*4096*128*40 = 41,943,040; SwiGLU
    # MLP 3hf = 3*4096*14336 = 176,160,768; two RMSNorms 2h = 8,192: 218,112,000. The
    # block: 32 layers 6,979,584,000 + the final norm 4,096 = 6,979,588,096. Untied
    # embedding and output layer 2hV = 2*4096*128,256 = 1,050,673,152 (V stays 128,256:
    # make_vocab_size_divisible_by 32 x t 4 = 128 divides it). Total 8,030,261,248,
    # Llama-3-8B's count.
    block = L * (2 * h * d * (a + g) + 3 * h * f + 2 * h) + h
    assert block == 6_979_588_096
    assert result["padded_vocab_size"] == V
    assert result["num_parameters"] == block + 2 * h * V == 8_030_261_248

    # Weights and optimizer of the most loaded rank (the first stage: 16 layers and the
    # embedding): over t the layers' 16 x 218,103,808 weights and the embedding hV, plus
    # their norms 16 x 8,192, whole on every rank: (3,489,660,928 + 525,336,576) / 4 +
    # 131,072 = 1,003,880,448 parameters at 2 (bf16) + 4 (fp32 gradient) + 12 / dp 8 (the
    # distributed optimizer's fp32 main copy and two Adam moments) = 7.5 bytes:
    # 7,529,103,360 bytes = 7,180.3 MB.
    shard = (L // p * (2 * h * d * (a + g) + 3 * h * f) + h * V) / t + L // p * 2 * h
    assert result["pipeline_stage"] == 0
    assert result["parameters_on_most_loaded_shard"] == shard == 1_003_880_448
    assert result["bytes_per_parameter"] == 7.5
    assert result["weight_and_optimizer_mb"] == pytest.approx(7_529_103_360 / MB)

    # Activations of the first stage (sequence parallel + selective recompute): per layer
    # sbh(18 + 4f/h) / t = 8192*4096*(18 + 14) / 4 = 268,435,456 bytes, x 32 layers (p
    # micro-batches in flight x L / p layers) = 8,589,934,592; the embedding's (8sb + sbh)
    # / t per in-flight micro-batch: 2 x 8,404,992 = 16,809,984. 1F1B with m = 16 >= p
    # keeps the factor min(1, m / p) = 1. Total 8,606,744,576 bytes = 8,208.03 MB.
    sbh = s * h
    layer = sbh * (18 + 4 * f / h) / t
    assert layer == 268_435_456
    activations = layer * L + (8 * s + sbh) / t * p
    assert activations == 8_606_744_576
    assert result["activation_mb"] == pytest.approx(activations / MB)

    # FLOPs per token (3 GEMMs of 2 FLOPs per multiply-add): 6[h(ad + 2gd) + ad s + ad h]
    # per layer for attention = 6 x 75,497,472, 6 x 3hf = 6 x 176,160,768 per layer for
    # the MLP, 6hV for the logits; summed: 6 x 8,578,400,256 = 51,470,401,536; times
    # B s = 128 x 8192 tokens: 5.397e16 per iteration.
    attention = h * (a * d + 2 * g * d) + a * d * s + a * d * h
    assert attention == 75_497_472
    per_token = 6 * (L * (attention + 3 * h * f) + h * V)
    assert per_token == 51_470_401_536
    assert result["flops_per_iteration"] == per_token * 128 * s == 53_970_627_761_012_736


def test_llama_8b_layout():
    config = load("llama-8b.yaml")
    parallel, model, optimizer = config.parallel, config.model, config.optimizer
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (4, 2)
    assert model.sequence_parallel and model.recompute_granularity == "selective"
    assert optimizer.use_distributed_optimizer and optimizer.bf16
    assert model.params_dtype == torch.bfloat16
    assert model.rotary_base == 500000 and model.untie_embeddings_and_output_weights
    # The layout holds at other cluster sizes with the same batch: 32 nodes, and 2.
    assert validate(config, 256)["num_microbatches"] == 4
    assert validate(config, 16)["num_microbatches"] == 64


def test_mixtral_8x7b_estimate_by_hand():
    config = load("mixtral-8x7b.yaml")
    result = estimate(config, 64, vocab_size=32000)
    print("mixtral-8x7b.yaml at 64 ranks:", result)
    h, a, g, d, E, k, f, L, V, s = 4096, 32, 8, 128, 8, 2, 14336, 32, 32000, 4096
    t, p, e, B = 2, 4, 8, 256

    # Parameters. Per layer: attention 2hd(a + g) = 41,943,040; 8 SwiGLU experts 3hfE =
    # 1,409,286,144; the router hE = 32,768; two RMSNorms 2h = 8,192: 1,451,270,144. The
    # block: 32 layers + the final norm 4,096 = 46,440,648,704. Untied embedding and
    # output layer 2hV = 262,144,000 (V stays 32,000: make_vocab_size_divisible_by 128 x
    # t 2 = 256 divides it). Total 46,702,792,704: Mixtral-8x7B's 46.7B (Jiang et al.
    # 2024, "Mixtral of Experts"; the Hugging Face model's count to the parameter).
    attention = 2 * h * d * (a + g)
    experts = 3 * h * f * E
    layer = attention + experts + h * E + 2 * h
    assert layer == 1_451_270_144
    assert result["padded_vocab_size"] == V
    assert result["num_parameters"] == L * layer + h + 2 * h * V == 46_702_792_704
    # Per token only k = 2 of the 8 experts run: 46,702,792,704 - 32 x 6/8 x experts =
    # 12,879,925,248, the published 12.9B active parameters.
    active = L * (layer - experts + experts * k // E) + h + 2 * h * V
    assert result["num_active_parameters"] == active == 12_879_925_248
    assert active == pytest.approx(12.9e9, rel=5e-3)

    # Weights and optimizer of the most loaded rank (the first stage, 8 layers). Dense:
    # the attention and the embedding over t, (8 x 41,943,040 + 131,072,000) / 2 =
    # 233,308,160, and the router and norms whole, 8 x 40,960: 233,635,840 at 6 + 12 / dp
    # 8 = 7.5 bytes. Experts: 8 layers' experts over e x expert-t = 8: 1,409,286,144 (one
    # expert per layer) at 6 + 12 / expert-dp 2 = 12 bytes (each stage's 16 ranks are 8 x 2).
    dense = (L // p * attention + h * V) / t + L // p * (h * E + 2 * h)
    assert result["parameters_on_most_loaded_shard"] == dense == 233_635_840
    expert_shard = L * experts / p / e
    assert result["expert_parameters_on_most_loaded_shard"] == expert_shard == 1_409_286_144
    assert config.parallel.expert_data_parallel_size(64) == 2
    weights = dense * 7.5 + expert_shard * 12
    assert weights == 18_663_702_528
    assert result["weight_and_optimizer_mb"] == pytest.approx(weights / MB)  # 17,799 MB

    # Activations (sequence parallel + selective recompute), f replaced by k f = 28,672:
    # sbh(18 + 4kf/h) / t = 16,777,216 x 46 / 2 = 385,875,968 bytes a layer, x 32 layers
    # (p micro-batches in flight x L / p), plus (8sb + sbh) / t per in-flight micro-batch:
    # 4 x 8,404,992. Total 12,381,650,944 bytes = 11,808 MB.
    sbh = s * h
    activations = sbh * (18 + 4 * k * f / h) / t * L + (8 * s + sbh) / t * p
    assert activations == 12_381_650_944
    assert result["activation_mb"] == pytest.approx(activations / MB)

    # FLOPs per token: 6[h(ad + 2gd) + ad s + ad h] = 6 x 58,720,256 for attention and
    # 6 x 3hkf = 6 x 352,321,536 for the two experts a token visits, per layer; 6hV for
    # the logits: 6 x 13,284,409,344 = 79,706,456,064, times B s = 256 x 4096 tokens.
    per_token = 6 * (L * (h * (a * d + 2 * g * d) + a * d * s + a * d * h + 3 * h * k * f)
                     + h * V)  # fmt: skip
    assert per_token == 79_706_456_064
    assert result["flops_per_iteration"] == per_token * B * s == 83_578_276_873_764_864


def test_mixtral_8x7b_layout():
    config = load("mixtral-8x7b.yaml")
    parallel, model, optimizer = config.parallel, config.model, config.optimizer
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == (2, 4)
    assert (parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size) == (8, 1)
    assert model.sequence_parallel and optimizer.use_distributed_optimizer and optimizer.bf16
    assert model.params_dtype == torch.bfloat16
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size) == (
        8, 2, 14336,
    )  # fmt: skip
    assert model.moe_layer_pattern() == [True] * 32
    assert model.moe_token_dispatcher_type == "alltoall" and model.moe_grouped_gemm
    assert model.moe_aux_loss_coeff == 0.02
    assert model.rotary_base == 1_000_000 and model.layernorm_epsilon == 1e-5
    assert model.untie_embeddings_and_output_weights and not model.add_bias_linear
    # At 32 nodes the same batch is 8 micro-batches per pipeline (dp 32, expert dp 8).
    assert validate(config, 256)["num_microbatches"] == 8
    assert parallel.expert_data_parallel_size(256) == 8
    # Expert parallel must divide the 8 experts and fit each stage's t x dp ranks.
    with pytest.raises(ValueError, match="expert_model_parallel_size=16"):
        estimate(parse_config(["--config", str(APP / "configs" / "mixtral-8x7b.yaml"),
                               "--expert-model-parallel-size", "16"], environ=ENVIRON),
                 64, vocab_size=32000)  # fmt: skip


def _generator():
    path = ROOT / "ci" / "gen_config_docs.py"
    spec = importlib.util.spec_from_file_location("gen_config_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_fresh():
    expected = _generator().render()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == expected, (
        "docs/configuration.md is stale: run `uv run python ci/gen_config_docs.py`"
    )


def test_shipped_configs_are_found_by_name():
    from mp_gpt.config_files import config_names, config_path

    assert config_names() == sorted(p.name for p in (APP / "configs").glob("*.yaml"))
    assert config_path("tiny.yaml").read_bytes() == (APP / "configs" / "tiny.yaml").read_bytes()
    with pytest.raises(FileNotFoundError, match=r"no shipped config named 'nano.yaml'.*tiny"):
        config_path("nano.yaml")


def test_the_wheel_carries_the_configs():
    import tomllib

    wheel = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    assert wheel["targets"]["wheel"]["force-include"] == {"configs": "mp_gpt/configs"}
