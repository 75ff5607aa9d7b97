"""Fine-tuning a Hugging Face Mamba-hybrid model in one command: `--load HF_DIR` (a random
Nemotron-H saved by transformers: Mamba, attention and MLP layers) at TP2, each rank
reading its groups of Mamba heads; a run that only loads and exports gives back every
tensor of the directory, and a run that trains exports a directory transformers loads,
whose logits equal the run's final save."""

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


def nemotron_h_folder(folder) -> None:
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, layers_block_type=["mamba", "full_attention", "mlp",
        "mamba"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        ssm_state_size=16, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.NemotronHForCausalLM(config).save_pretrained(folder)


def options(hf_dir, run_dir, *extra):
    return [
        "--load", str(hf_dir), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "200", "--seq-length", str(SEQ), "--tensor-model-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--eval-interval", "none", "--log-interval", "1",
        "--tensorboard-dir", "none", "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--num-workers", "0", *GIVEN_PEAK, *extra,
    ]  # fmt: skip


def test_finetune_a_hugging_face_hybrid_model_at_tp2_and_export_it(tmp_path):
    hf_dir, run_dir = tmp_path / "nemotron_h", tmp_path / "run"
    nemotron_h_folder(hf_dir)
    only_export = options(
        hf_dir,
        tmp_path,
        "--skip-train",
        "--train-iters",
        "1",
        "--no-initialization",
        "--export-hf-dir",
        str(tmp_path / "same"),
    )
    finetune = options(hf_dir, run_dir, "--train-iters", "4", "--save", str(run_dir / "ckpt"),
                       "--export-hf-dir", str(tmp_path / "tuned"))  # fmt: skip
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
    assert type(tuned).__name__ == "NemotronHForCausalLM"
    mixer = "backbone.layers.0.mixer.in_proj.weight"
    trained = load_file(str(tmp_path / "tuned" / "model.safetensors"))
    assert trained.keys() == source.keys() and not torch.equal(trained[mixer], source[mixer])
    ours, common = saved_model(run_dir / "ckpt", SEQ)
    assert common["family"] == "nemotron_h"
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (tuned(x).logits - ours(x)).abs().max() < 1e-5
