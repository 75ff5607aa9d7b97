"""Greedy generation equals transformers' generate(do_sample=False), token for token over
32 new tokens: random GPT-2 and Llama models (no downloads) imported by `mp-ckpt
import-hf` without a tokenizer (token ids in and out), three prompts of different
lengths in one batch (left-padded, KV cache), at TP1, TP2 and PP2; and the command's JSON
output for such a checkpoint."""

import contextlib
import io
import json
import os

import pytest
import torch

from mp_ckpt.cli import main as mp_ckpt_main
from mp_gpt.testing import greedy_on_rank, reference_greedy
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

NEW = 32
PROMPTS = [[5, 17, 3, 88, 41], [9], [60, 2, 2, 71, 30, 12, 33, 50, 7]]
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=4, initializer_range=0.5,
    )),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False,
    )),
}  # fmt: skip
LAYOUTS = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", "2"]),
           "pp2": (2, ["--pipeline-model-parallel-size", "2"])}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def imported(request, tmp_path_factory):
    """(checkpoint, transformers' greedy new tokens per prompt)."""
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = MODELS[request.param]().eval()
    hf.save_pretrained(folder / "hf")
    assert mp_ckpt_main(["import-hf", str(folder / "hf"), str(folder / "ckpt")]) == 0
    return str(folder / "ckpt"), reference_greedy(hf, PROMPTS, NEW)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_equals_transformers_generate(imported, layout):
    checkpoint, want = imported
    ranks, options = LAYOUTS[layout]
    for got in run_on_ranks(greedy_on_rank, ranks, checkpoint, options, PROMPTS, NEW, timeout=180):
        assert got == want


def command_body(checkpoint: str) -> str:
    torch.set_num_threads(1)
    from mp_gpt.generate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--load", checkpoint, "--prompt-token-ids", "5,17,3,88,41",
              "--prompt-token-ids", "9", "--max-new-tokens", str(NEW),
              "--output-format", "json"])  # fmt: skip
    return out.getvalue()


@pytest.mark.multirank
def test_the_command_prints_token_ids_and_logprobs_as_json(imported):
    checkpoint, want = imported
    printed = run_on_ranks(command_body, 1, checkpoint, timeout=180)[0]
    records = [json.loads(line) for line in printed.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == PROMPTS[:2]
    assert [r["token_ids"] for r in records] == want[:2]
    for record in records:
        assert "text" not in record  # no tokenizer: ids only
        assert len(record["logprobs"]) == NEW and all(lp <= 0 for lp in record["logprobs"])
        assert record["finish_reason"] == "length"
