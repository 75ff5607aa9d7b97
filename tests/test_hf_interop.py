"""Hugging Face -> mp -> Hugging Face, exactly: a random transformers model imported by
`mp-ckpt import-hf` gives transformers' logits in GPTModel (built from the imported
settings alone), and `mp-ckpt export-hf` gives back its config and every tensor;
the tokenizer and generation settings travel both ways. A checkpoint saved by mp's
training exports with its model's settings (activation, rotary base and scaling).
Mixtral and Qwen2-MoE come back as transformers' save_pretrained wrote them (config.json
and every per-expert tensor), from its files or from its fused in-memory state dict."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mp_ckpt import Checkpointer, CheckpointReader, load_checkpoint
from mp_ckpt.cli import main
from mp_ckpt.hf import logical_from_hf
from mp_gpt.testing import GIVEN_PEAK, imported_model
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state import RankGroup
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SINGLE = RankGroup("single", (0,), 0, None)
SEQ = 24
LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
             max_position_embeddings=SEQ, initializer_range=0.2)  # fmt: skip
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
CASES = {
    # GPT-2's default activation is gelu_new (the tanh approximation).
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=96, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        layer_norm_epsilon=1e-4, bos_token_id=3, eos_token_id=5,
    ),
    "gpt2-exact-gelu-n-inner": lambda: transformers.GPT2Config(
        vocab_size=96, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, n_inner=96,
        activation_function="gelu", initializer_range=0.2,
    ),
    "llama-untied": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True),
    "llama-theta-500000": lambda: transformers.LlamaConfig(
        **LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
    ),
    "llama3-scaling": lambda: transformers.LlamaConfig(
        **LLAMA, rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING}
    ),
    "llama-linear-scaling": lambda: transformers.LlamaConfig(
        **LLAMA, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    ),
}  # fmt: skip
# initializer_range 0.1: routing still varies token to token, and the logits stay small
# enough that fp32 rounding (the two implementations differ by ~1e-5 at 0.2) keeps clear
# of the 1e-5 tolerance.
MOE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
           num_key_value_heads=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
           max_position_embeddings=SEQ, initializer_range=0.1)  # fmt: skip
QWEN2_MOE = dict(MOE, intermediate_size=80, moe_intermediate_size=48, num_experts=4,
                 shared_expert_intermediate_size=56)  # fmt: skip
MOE_CASES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **MOE, head_dim=8, intermediate_size=48, num_local_experts=4, router_aux_loss_coef=0.02
    ),
    # layer 1 dense; top-k weights are the full softmax's (norm_topk_prob False)
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**QWEN2_MOE, mlp_only_layers=[1]),
    # layer 1 sparse (every 2nd); top-k weights renormalized; no qkv bias; tied output
    "qwen2_moe-step2-norm-topk": lambda: transformers.Qwen2MoeConfig(
        **QWEN2_MOE, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
CASES |= MOE_CASES
HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}  # fmt: skip
# GPTModel builds a mixture of experts once mp_layers' TransformerConfig has its fields.
needs_moe_layer = pytest.mark.skipif(
    "num_moe_experts" not in TransformerConfig.__dataclass_fields__,
    reason="mp_layers.TransformerConfig has no num_moe_experts (no MoE layer in this tree)",
)


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


def random_hf(config):
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASSES[config.model_type])(config).eval()
    if config.model_type in ("mixtral", "qwen2_moe"):
        with torch.no_grad():  # biases start at 0 and norms at 1: give them values to map
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return model


def hf_config_dict(folder) -> dict:
    config = transformers.AutoConfig.from_pretrained(folder).to_dict()
    config.pop("_name_or_path")
    return config


@pytest.mark.parametrize(
    "case", [c if c not in MOE_CASES else pytest.param(c, marks=needs_moe_layer)
             for c in sorted(CASES)],
)  # fmt: skip
def test_import_gives_transformers_logits_and_export_gives_back_config_and_tensors(tmp_path, case):
    hf = random_hf(CASES[case]())
    hf.save_pretrained(tmp_path / "hf_in")
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    model = imported_model(tmp_path / "ckpt")
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5

    arch = hf.config.model_type
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out"), "--arch", arch]
    assert main(args) == 0
    assert hf_config_dict(tmp_path / "hf_out") == hf_config_dict(tmp_path / "hf_in")
    written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    original = json.loads((tmp_path / "hf_in" / "config.json").read_text())
    kept = ("activation_function", "n_inner", "layer_norm_epsilon", "rms_norm_eps",
            "rope_parameters", "bos_token_id", "eos_token_id", "tie_word_embeddings")  # fmt: skip
    for key in kept:
        assert written.get(key) == original.get(key), key
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    source = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = type(hf).from_pretrained(tmp_path / "hf_out").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_export_writes_what_save_pretrained_wrote(tmp_path, case):
    hf = random_hf(MOE_CASES[case]())
    hf.save_pretrained(tmp_path / "hf_in")
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    arch = hf.config.model_type
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out"), "--arch", arch]
    assert main(args) == 0

    written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    original = json.loads((tmp_path / "hf_in" / "config.json").read_text())
    original.pop("transformers_version")
    assert written == original
    assert hf_config_dict(tmp_path / "hf_out") == hf_config_dict(tmp_path / "hf_in")
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    source = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    assert any(".experts.3." in name for name in source)  # save_pretrained writes per expert
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = type(hf).from_pretrained(tmp_path / "hf_out").eval()
    x = ids(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_fused_state_dict_imports_as_its_saved_files(tmp_path, case):
    hf = random_hf(MOE_CASES[case]())
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    state = hf.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    fused = logical_from_hf(state, config)
    saved = logical_from_hf(load_file(str(tmp_path / "model.safetensors")), config)
    assert fused.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(fused[name], tensor), name


def tiny_tokenizer(special: list[str]):
    """A byte-level BPE trained on a sentence (no download)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, then naps"] * 8,
                            trainer)  # fmt: skip
    return tok


TEXT = "the lazy fox naps, the quick dog jumps"


def hf_folder_with_tokenizer(folder, arch: str):
    """A random model of `arch` saved with a tiny tokenizer: (model, tokenizer)."""
    if arch == "gpt2":
        backend = tiny_tokenizer(["<|endoftext|>"])
        tokenizer = transformers.GPT2TokenizerFast(
            tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
        )
        config = transformers.GPT2Config(vocab_size=backend.get_vocab_size(), n_positions=SEQ,
                                         n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
                                         bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    else:
        backend = tiny_tokenizer(["<s>", "</s>", "<pad>"])
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
        )
    if arch in MOE_CASES:
        config = MOE_CASES[arch]()
        config.vocab_size = backend.get_vocab_size()
        for role in ("bos", "eos", "pad"):
            setattr(config, f"{role}_token_id", getattr(tokenizer, f"{role}_token_id"))
    elif arch == "llama":
        config = transformers.LlamaConfig(**LLAMA | {"vocab_size": backend.get_vocab_size()},
                                          tie_word_embeddings=True,
                                          bos_token_id=tokenizer.bos_token_id,
                                          eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    hf = random_hf(config)
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return hf, tokenizer


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral", "qwen2_moe"])
def test_tokenizer_and_generation_travel_through_import_and_export(tmp_path, arch):
    hf, tokenizer = hf_folder_with_tokenizer(tmp_path / "hf_in", arch)
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out"), "--arch", arch]
    assert main(args) == 0

    source = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_in")
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out")
    assert exported(TEXT).input_ids == source(TEXT).input_ids
    assert len(source(TEXT).input_ids) < len(TEXT)  # merges applied, not bytes
    generation = json.loads((tmp_path / "hf_out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id

    prompt = exported(TEXT, return_tensors="pt").input_ids[:, :8]
    reloaded = type(hf).from_pretrained(tmp_path / "hf_out").eval()
    kwargs = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        got = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    assert got.shape == (1, 14) and torch.equal(got, want)


def generate_body(checkpoint: str, prompt: str) -> str:

    torch.set_num_threads(1)
    from mp_gpt.generate import run_generation

    return run_generation(["--load", checkpoint, "--prompt", prompt, "--max-new-tokens", "6",
                           "--seq-length", str(SEQ)])  # fmt: skip


@pytest.mark.parametrize(
    "arch", ["gpt2", "llama", *(pytest.param(a, marks=needs_moe_layer)
                                for a in ("mixtral", "qwen2_moe"))],
)  # fmt: skip
def test_generate_on_an_imported_checkpoint_uses_its_tokenizer(tmp_path, arch):
    hf, tokenizer = hf_folder_with_tokenizer(tmp_path / "hf_in", arch)
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    prompt = "the lazy fox"
    text = run_on_ranks(generate_body, 1, str(tmp_path / "ckpt"), prompt, timeout=120)[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False)[0, ids.shape[1]:].tolist()  # fmt: skip
    new = [t for t in out if t != tokenizer.eos_token_id]
    assert len(new) > 0
    assert text == prompt + tokenizer.decode(new)


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_export_writes_the_tokenizer_of_a_checkpoint_trained_with_it(tmp_path, kind):
    from mp_data import build_tokenizer

    backend = tiny_tokenizer(["<|endoftext|>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    if kind == "GPT2BPETokenizer":
        backend.model.save(str(folder))  # vocab.json, merges.txt
        data = {"vocab_file": str(folder / "vocab.json"), "merge_file": str(folder / "merges.txt"),
                "tokenizer_model": None}  # fmt: skip
    else:
        backend.save(str(folder / "tokenizer.json"))  # no role files: eod is <|endoftext|>
        data = {"vocab_file": None, "merge_file": None, "tokenizer_model": str(folder)}
    data["tokenizer_type"] = kind
    ours = build_tokenizer(kind, vocab_file=data["vocab_file"], merge_file=data["merge_file"],
                           tokenizer_model=data["tokenizer_model"])  # fmt: skip
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    model = GPTModel(config, "local", 320, SEQ, groups=ModelGroups.single())
    common = {"config": {"data": data}, "model_config": {"max_position_embeddings": SEQ}}
    Checkpointer(tmp_path / "ckpt").save(3, model.sharded_state_dict(), common=common)
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--arch", "gpt2"]
    assert main(args) == 0

    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported(TEXT).input_ids == ours.tokenize(TEXT)
    assert exported.eos_token_id == ours.eod
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    want = {"eos_token_id": ours.eod}
    if kind == "GPT2BPETokenizer":  # Megatron's GPT-2: <|endoftext|> is bos too
        want["bos_token_id"] = ours.eod
    assert generation == want


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
         "rope_type='yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)  # fmt: skip
def test_import_refuses_what_mp_cannot_compute(tmp_path, capsys, change, message):
    random_hf(CASES["llama-untied"]()).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters")
    path.write_text(json.dumps(config | change))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(add_qkv_bias=True), "has no place for decoder.layers.0.self_attention.linear_qkv"),
        (dict(qk_layernorm=True), "has no place for"),
        (dict(num_query_groups=4, untie_embeddings_and_output_weights=False, arch="gpt2"),
         "grouped-query attention"),
    ],
)  # fmt: skip
def test_export_refuses_tensors_the_architecture_has_no_place_for(tmp_path, capsys, change,
                                                                  message):  # fmt: skip
    arch = change.pop("arch", "llama")
    style = dict(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                 ffn_hidden_size=96, normalization="RMSNorm", activation="swiglu",
                 position_embedding_type="rope", add_bias_linear=False,
                 untie_embeddings_and_output_weights=True)  # fmt: skip
    if arch == "gpt2":
        style = dict(num_layers=1, hidden_size=64, num_attention_heads=8)
    config = TransformerConfig(**style | change, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, "local", 96, SEQ, groups=ModelGroups.single())
    Checkpointer(tmp_path / "ckpt").save(1, model.sharded_state_dict())
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--arch", arch]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "hf" / "config.json").exists()


def test_import_refuses_an_unknown_gpt2_activation(tmp_path, capsys):
    random_hf(CASES["gpt2"]()).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"activation_function": "relu"}))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    assert "activation_function='relu'" in capsys.readouterr().err


# --- checkpoints saved by mp's training ---

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"
TRAIN_SEQ = 32
TRAINED_STYLES = {
    "gpt2": ["--normalization", "LayerNorm", "--activation", "gelu", "--openai-gelu",
             "--position-embedding-type", "learned_absolute", "--add-bias-linear",
             "--num-query-groups", "4", "--ffn-hidden-size", "256"],
    "llama": ["--use-rope-scaling", "--rope-scaling-factor", "4",
              "--rope-scaling-original-max-position-embeddings", "64",
              "--rotary-base", "500000", "--untie-embeddings-and-output-weights"],
    "mixtral": ["--num-moe-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2",
                "--moe-aux-loss-coeff", "0.01", "--untie-embeddings-and-output-weights"],
    # layer 0 sparse, layer 1 dense; the top 2 of the full softmax, not renormalized
    "qwen2_moe": ["--num-moe-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk",
                  "2", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "64",
                  "--moe-shared-expert-gate", "--moe-layer-freq", "2", "--add-qkv-bias"],
}  # fmt: skip


def train_body(run_dir: str, extra: list[str]):
    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import main as pretrain

    return pretrain([
        "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "200", "--make-vocab-size-divisible-by", "128",
        "--seq-length", str(TRAIN_SEQ), "--num-layers", "2", "--hidden-size", "64",
        "--init-method-std", "0.2", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--eval-interval", "none", "--save", run_dir,
        "--tensorboard-dir", "none", "--num-workers", "0", "--lr-warmup-iters", "0",
        "--log-interval", "100", *extra,
    ])  # fmt: skip


@pytest.mark.parametrize("style", sorted(TRAINED_STYLES))
def test_a_trained_checkpoint_exports_with_its_activation_and_rotary_settings(tmp_path, style):
    run_on_ranks(train_body, 1, str(tmp_path / "run"), TRAINED_STYLES[style], timeout=120)
    common = torch.load(CheckpointReader(tmp_path / "run").directory / "common.pt",
                        weights_only=False)  # fmt: skip
    saved = common["config"]["model"]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig(**{k: v for k, v in saved.items() if k in fields and k not in
                                  ("params_dtype", "hidden_dropout", "attention_dropout")},
                               hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    assert config.openai_gelu == (style == "gpt2")
    assert config.use_rope_scaling == (style == "llama")
    vocab = common["model_config"]["vocab_size"]
    model = GPTModel(config, "local", vocab, TRAIN_SEQ, groups=ModelGroups.single()).eval()
    load_checkpoint(tmp_path / "run", model.sharded_state_dict(), strict=False)

    args = ["export-hf", str(tmp_path / "run"), str(tmp_path / "hf"), "--arch", style]
    assert main(args) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, vocab, (2, TRAIN_SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32 logits of magnitude ~4, summed in other orders (the MoE's experts): a few
        # units in their last place apart; a wrong setting moves them by more than 1e-2.
        assert (hf(x).logits - model(x)).abs().max() < 3e-5
