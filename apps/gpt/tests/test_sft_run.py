"""pretrain_gpt --sft: a run on chat JSONL trains on packed conversations, and what --sft
cannot run with is refused before any rank starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mp_data import write_chat_corpus, write_chat_tokenizer
from mp_gpt.config_files import config_path
from mp_gpt.testing import GIVEN_PEAK, HYBRID_OPTIONS, metrics_records, train_output_on_rank
from mp_state.testing import run_on_ranks
from mp_train import ConfigError, load_config

pytest.importorskip("transformers")


def sft_options(folder: Path, *extra: str) -> list[str]:
    """tiny.yaml (fp32) on folder/chat.jsonl rendered with folder/tokenizer's chat template:
    8 iterations of 8 samples of 64 tokens, metrics to folder/metrics.jsonl. As Megatron's
    SFT launch lines, --no-create-attention-mask-in-dataloader: the samples' document_ids
    keep the conversations apart all the same."""
    return [
        "--config", str(config_path("tiny.yaml")), "--sft",
        "--no-create-attention-mask-in-dataloader", "--sft-tokenizer-prompt-format",
        "default", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(folder / "tokenizer"), "--data-path", str(folder / "chat.jsonl"),
        "--split", "90,10,0", "--data-cache-path", str(folder / "cache"),
        "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "8", "--eval-interval", "none", "--log-interval", "10",
        "--lr-warmup-iters", "1", "--save", "none", "--load", "none",
        "--tensorboard-dir", "none", "--num-workers", "0",
        "--metrics-file", str(folder / "metrics.jsonl"), *GIVEN_PEAK, *extra,
    ]  # fmt: skip


@pytest.mark.multirank
def test_sft_run_trains_with_falling_loss(tmp_path):
    write_chat_tokenizer(str(tmp_path / "tokenizer"))
    write_chat_corpus(str(tmp_path / "chat.jsonl"), 200, long_every=50, long_words=60)
    [(status, out)] = run_on_ranks(train_output_on_rank, 1, sft_options(tmp_path), timeout=180)
    assert status == 0, out
    losses = [r["lm loss"] for r in metrics_records(tmp_path)]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.0, losses  # from ln(vocab) ~ 7 towards the pattern
    # The packing's one line per split, the truncated conversations counted.
    [train] = [line for line in out.splitlines() if "SFTDataset train" in line]
    assert "180 lines, 180 conversations in" in train
    assert "conversations longer than 65 tokens truncated" in train


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_sft_run_at_cp2_pads_conversations_for_the_document_split(tmp_path, model):
    """Under context parallelism each conversation is padded to 2 x cp tokens (Megatron's
    SFTDataset), so every document is split into chunks of its own on each rank; a
    Mamba-hybrid model's Mamba layer mixes each conversation alone across the two ranks
    (its CP2 numerics against one rank: mp-layers' test_mamba_packed_and_cp.py)."""
    write_chat_tokenizer(str(tmp_path / "tokenizer"))
    write_chat_corpus(str(tmp_path / "chat.jsonl"), 200, long_every=50, long_words=60)
    hybrid = HYBRID_OPTIONS if model == "hybrid" else ()
    options = sft_options(tmp_path, "--context-parallel-size", "2", *hybrid)
    outputs = run_on_ranks(train_output_on_rank, 2, options, timeout=180)
    assert all(status == 0 for status, _ in outputs), outputs
    losses = [r["lm loss"] for r in metrics_records(tmp_path)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    [train] = [line for line in outputs[0][1].splitlines() if "SFTDataset train" in line]
    assert "each conversation padded to a multiple of 4 tokens" in train


def run_with_long_prompts(folder: Path, long_every: int, iterations: int):
    """One rank's SFT run on 40 conversations, every `long_every`-th opening with a prompt
    longer than a sample (80 words: truncated, its sample holds no answer, so no loss
    token), in micro-batches of one and global batches of two: (what it printed, its
    metrics records)."""
    write_chat_tokenizer(str(folder / "tokenizer"))
    write_chat_corpus(str(folder / "chat.jsonl"), 40, long_every=long_every, long_words=80)
    options = sft_options(folder, "--micro-batch-size", "1", "--global-batch-size", "2",
                          "--train-iters", str(iterations))  # fmt: skip
    [(status, out)] = run_on_ranks(train_output_on_rank, 1, options, timeout=180)
    assert status == 0, out
    return out, metrics_records(folder)


@pytest.mark.multirank
def test_samples_whose_answers_were_cut_off_train_without_a_nan(tmp_path):
    """Every other sample holds no loss token. Such a micro-batch adds nothing to the step,
    as in Megatron-LM; its 0 / 0 made the step's gradients NaN and stopped the run."""
    _, records = run_with_long_prompts(tmp_path, long_every=2, iterations=4)
    assert len(records) == 4
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["lm loss"]) for r in records)


@pytest.mark.multirank
def test_a_global_batch_without_loss_tokens_steps_with_zero_gradients(tmp_path):
    """No sample holds a loss token. As in Megatron-LM the steps go on with zero gradients,
    the loss (0 / 0) logged nan; the nan check, which stopped the run at the first
    iteration, leaves it alone."""
    out, records = run_with_long_prompts(tmp_path, long_every=1, iterations=2)
    assert [r["grad_norm"] for r in records] == [0.0, 0.0]
    assert all(math.isnan(r["lm loss"]) for r in records)
    assert "iteration 2: the global batch holds no loss tokens" in out


def test_sft_refusals(tmp_path):
    write_chat_tokenizer(str(tmp_path / "tokenizer"))
    (tmp_path / "chat.jsonl").write_text("")
    base = sft_options(tmp_path)
    cases = [
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
         "--sft with --tokenizer-type NullTokenizer"),
        (["--data-path", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
        (["--mock-data", "--data-path", "a"], "--mock-data and --data-path: give a single"),
        (["--mock-data", "--data-path", "none"], "reads JSONL conversations; --mock-data has"),
    ]  # fmt: skip
    for extra, message in cases:
        environ = {"MP_RUN_DIR": "/nonexistent"}
        with pytest.raises(ConfigError, match=message):
            load_config([*base, *extra], environ=environ)
