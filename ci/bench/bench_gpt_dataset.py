"""Benchmark: random-access samples/s of GPTDataset at sequence length 2048.

A synthetic corpus of 40,000 documents (50 to 2,000 tokens, uint16, each closed
by an end-of-document token) is written once to a temporary folder; samples are
then read in a random order, plain and with reset_position_ids + eod_mask_loss.
The baseline, in the same run, reads the same number of tokens (2,049, as
int64) at random offsets of the memory-mapped .bin, so the ratio shows what
the sample lookup, masks and tensors cost over reading the tokens alone.
Targets: >= 20,000 samples/s plain, >= 10,000 with both options.

    uv run python ci/bench/bench_gpt_dataset.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
from harness import context, emit

from mp_data import GPTDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, Split

SEQUENCE_LENGTH = 2048
TARGETS = {"plain": 20_000, "reset_position_ids+eod_mask_loss": 10_000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="samples read per measure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = context()
    with tempfile.TemporaryDirectory() as folder:
        prefix = f"{folder}/bench_text_document"
        _write_corpus(prefix)
        dataset = IndexedDataset(prefix)
        rng = np.random.default_rng(1)
        raw_s = _raw_reads(prefix, rng, args.samples)
        tokenizer = SimpleNamespace(vocab_size=50257, eod=0, pad=None)
        for name, reset in (("plain", False), ("reset_position_ids+eod_mask_loss", True)):
            config = GPTDatasetConfig(
                random_seed=1, sequence_length=SEQUENCE_LENGTH, tokenizer=tokenizer,
                path_to_cache=f"{folder}/cache", create_attention_mask=False,
                reset_position_ids=reset, eod_mask_loss=reset,
            )  # fmt: skip
            ids = np.arange(len(dataset), dtype=np.int32)
            gpt = GPTDataset(dataset, prefix, ids, None, Split.train, config)
            order = rng.integers(0, len(gpt), args.samples).tolist()
            for i in order[:200]:  # warm the page cache and the code paths
                gpt[i]
            start = time.perf_counter()
            for i in order:
                gpt[i]
            seconds = time.perf_counter() - start
            rate = args.samples / seconds
            emit(
                f"gpt_dataset_random_access[{name}]",
                {
                    "samples_per_s": round(rate),
                    "raw_reads_per_s": round(args.samples / raw_s),
                    "ratio_to_raw_reads": round(rate / (args.samples / raw_s), 3),
                    "target_samples_per_s": TARGETS[name],
                    "meets_target": rate >= TARGETS[name],
                    "sequence_length": SEQUENCE_LENGTH,
                },
                ctx,
            )


def _write_corpus(prefix: str) -> None:
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in rng.integers(50, 2000, 40_000):
        builder.add_item(np.append(rng.integers(1, 50000, length - 1), 0))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _raw_reads(prefix: str, rng: np.random.Generator, count: int) -> float:
    """Seconds for `count` reads of SEQUENCE_LENGTH + 1 tokens at random offsets, as int64."""
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    starts = rng.integers(0, len(tokens) - SEQUENCE_LENGTH - 1, count).tolist()
    start = time.perf_counter()
    for i in starts:
        np.array(tokens[i : i + SEQUENCE_LENGTH + 1], dtype=np.int64)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
