"""Fine-tuning a Hugging Face Mamba-hybrid model in one command: `--load HF_DIR` at TP2 (a
random Nemotron-H saved by transformers: Mamba, attention and MLP layers; a Granite 4.0-H:
Mamba and attention mixers each followed by experts beside a shared MLP, Granite's scales;
a Bamba: Mamba and attention mixers each followed by a SwiGLU MLP), each rank reading its
groups of Mamba heads; a run that only loads and exports gives back every tensor of the
directory, and a run that trains exports a directory transformers loads, whose logits
equal the run's final save."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mp_gpt.testing import GIVEN_PEAK, runs_on_rank, saved_model
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multirank

SEQ, VOCAB = 32, 256


CONFIGS = {
    "nemotron_h": lambda: transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, layers_block_type=["mamba", "full_attention", "mlp",
        "mamba"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=16, max_position_embeddings=128, tie_word_embeddings=False),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, layer_types=["mamba", "attention", "mamba"],
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=8, mamba_expand=1,
        mamba_n_groups=2, mamba_d_state=16, max_position_embeddings=128,
        embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
        logits_scaling=4.0),
    "bamba": lambda: transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8,
        mamba_d_head=8, mamba_expand=1, mamba_n_groups=2, mamba_d_state=16,
        max_position_embeddings=128),
}  # fmt: skip
MIXER = {"nemotron_h": "backbone.layers.0.mixer.in_proj.weight",
         "granitemoehybrid": "model.layers.0.mamba.in_proj.weight",
         "bamba": "model.layers.0.mamba.in_proj.weight"}  # fmt: skip
LAYOUT = {"nemotron_h": [], "granitemoehybrid": ["--sequence-parallel"], "bamba": []}
"""Experts under TP need sequence parallelism (each rank routes its share of the tokens)."""
ARCHITECTURE = {"nemotron_h": "NemotronHForCausalLM",
                "granitemoehybrid": "GraniteMoeHybridForCausalLM",
                "bamba": "BambaForCausalLM"}  # fmt: skip


def hybrid_folder(folder, family: str) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).save_pretrained(folder)


def options(hf_dir, run_dir, *extra):
    return [
        "--load", str(hf_dir), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "200", "--seq-length", str(SEQ), "--tensor-model-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--eval-interval", "none", "--log-interval", "1",
        "--tensorboard-dir", "none", "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--num-workers", "0", *GIVEN_PEAK, *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_finetune_a_hugging_face_hybrid_model_at_tp2_and_export_it(tmp_path, family):
    hf_dir, run_dir = tmp_path / family, tmp_path / "run"
    hybrid_folder(hf_dir, family)
    only_export = options(
        hf_dir,
        tmp_path,
        "--skip-train",
        "--train-iters",
        "1",
        "--no-initialization",
        "--export-hf-dir",
        str(tmp_path / "same"),
        *LAYOUT[family],
    )
    finetune = options(hf_dir, run_dir, "--train-iters", "4", "--save", str(run_dir / "ckpt"),
                       "--export-hf-dir", str(tmp_path / "tuned"), *LAYOUT[family])  # fmt: skip
    run_on_ranks(runs_on_rank, 2, only_export, finetune, timeout=300)

    source = load_file(str(hf_dir / "model.safetensors"))
    same = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert same.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(same[name], tensor), name

    losses = [json.loads(line)["lm loss"]
              for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    assert type(tuned).__name__ == ARCHITECTURE[family]
    mixer = MIXER[family]
    trained = load_file(str(tmp_path / "tuned" / "model.safetensors"))
    assert trained.keys() == source.keys() and not torch.equal(trained[mixer], source[mixer])
    ours, common = saved_model(run_dir / "ckpt", SEQ)
    assert common["family"] == family
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (tuned(x).logits - ours(x)).abs().max() < 1e-5
