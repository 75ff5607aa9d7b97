"""The mp-ckpt command line on real GPT checkpoints: export-hf / import-hf against
transformers, convert, inspect."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mp_ckpt import Checkpointer, load_checkpoint
from mp_ckpt.cli import main
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state import RankGroup

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SINGLE = RankGroup("single", (0,), 0, None)
VOCAB, SEQ = 96, 16
STYLES = {
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  kv_channels=8, ffn_hidden_size=96, normalization="RMSNorm",
                  layernorm_epsilon=1e-6, activation="swiglu", position_embedding_type="rope",
                  rotary_base=10000, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
}  # fmt: skip


def ours(style: str, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(**STYLES[style], hidden_dropout=0.0, attention_dropout=0.0,
                               init_method_std=0.2)  # fmt: skip
    return GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single()).eval()


def save(model: GPTModel, root, style: str) -> None:
    settings = {k: v for k, v in STYLES[style].items() if k in ("layernorm_epsilon", "rotary_base")}
    settings["max_position_embeddings"] = SEQ
    Checkpointer(root).save(5, model.sharded_state_dict(), common={"model_config": settings})


def ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_export_hf_loads_in_transformers_with_our_logits(tmp_path, style):
    model = ours(style)
    save(model, tmp_path / "ckpt", style)
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--arch", style]) == 0
    cls = transformers.GPT2LMHeadModel if style == "gpt2" else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(ids()).logits - model(ids())).abs().max() < 1e-4


def test_export_hf_shards_above_the_size_limit(tmp_path):
    save(ours("llama"), tmp_path / "ckpt", "llama")
    args = ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--arch", "llama",
            "--max-shard-size", "40KB"]  # fmt: skip
    assert main(args) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_import_hf_gives_transformers_logits_and_round_trips(tmp_path, style):
    torch.manual_seed(1)
    if style == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
            activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ))  # fmt: skip
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
            max_position_embeddings=SEQ, tie_word_embeddings=False,
        ))  # fmt: skip
    hf.eval().save_pretrained(tmp_path / "hf_in")
    assert main(["import-hf", str(tmp_path / "hf_in"), str(tmp_path / "ckpt")]) == 0
    model = ours(style, seed=9)  # other weights until loaded
    load_checkpoint(tmp_path / "ckpt", model.sharded_state_dict())
    with torch.no_grad():
        assert (hf(ids()).logits - model(ids())).abs().max() < 1e-4
    assert (
        main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf_out"), "--arch", style]) == 0
    )
    exported = load_file(str(tmp_path / "hf_out" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf_in" / "model.safetensors"))
    assert set(exported) <= set(original)
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name


def test_import_hf_errors_name_the_problem(tmp_path, capsys):
    assert main(["import-hf", str(tmp_path / "nothing"), str(tmp_path / "ckpt")]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["import-hf", str(tmp_path / "bert"), str(tmp_path / "ckpt")]) == 2
    assert "unsupported model_type 'bert'" in capsys.readouterr().err
    save(ours("gpt2"), tmp_path / "c", "gpt2")
    with pytest.raises(SystemExit):
        main(["export-hf", str(tmp_path / "c"), str(tmp_path / "o"), "--arch", "bloom"])


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_convert_then_load_gives_the_same_tensors(tmp_path, tp, pp):
    model = ours("llama")
    save(model, tmp_path / "ckpt", "llama")
    args = ["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--no-progress"]  # fmt: skip
    assert main(args) == 0
    meta = json.loads((tmp_path / "out" / "iter_0000005" / "mp_metadata.json").read_text())
    assert meta["world_size"] == tp * pp
    q = [
        c
        for c in meta["chunks"]
        if c["key"].endswith("layers.1.self_attention.linear_qkv.q.weight")
    ]
    assert len(q) == tp and {c["rank"] // tp for c in q} == {pp - 1}
    copy = ours("llama", seed=5)
    load_checkpoint(tmp_path / "out", copy.sharded_state_dict())
    for (name, a), b in zip(model.state_dict().items(), copy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_inspect_lists_tensors_and_totals(tmp_path, capsys):
    model = ours("gpt2")
    save(model, tmp_path / "ckpt", "gpt2")
    assert main(["inspect", str(tmp_path / "ckpt"), "--json", "--verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iteration"] == 5 and summary["problems"] == []
    assert summary["model_parameters"] == sum(p.numel() for p in model.parameters())
    names = {t["name"]: t for t in summary["tensors"]}
    assert names["embedding.word_embeddings.weight"]["shape"] == [VOCAB, 64]
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "model parameters" in capsys.readouterr().out
