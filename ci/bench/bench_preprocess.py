"""Benchmark: `mp-data preprocess` tokens/s at 1 and 2 workers, beside the bare tokenizer.

The corpus is real English text available offline: at least 20 MB of the
documentation strings of the installed Python code (mp_data.python_corpus),
one JSON line per docstring. The baseline, in the same run, is the GPT-2 BPE
tokenizer alone, single-threaded, on the same documents already in memory.
preprocess then reads the file, parses the JSON, tokenizes, appends eod and
writes .bin/.idx, called in-process (interpreter start-up excluded).
Targets: workers=1 >= 0.8x the bare tokenizer; workers=2 >= 1.6x workers=1.

    uv run python ci/bench/bench_preprocess.py [--corpus PATH] [--megabytes 20]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported

from harness import context, emit

from mp_data import GPT2BPETokenizer, IndexedDataset
from mp_data.cli import main as mp_data_main
from mp_data.python_corpus import write_docstring_corpus

ASSETS = os.path.join(
    os.path.dirname(__file__), "..", "..", "packages", "mp-data", "tests", "assets", "tokenizers"
)
VOCAB = os.path.join(ASSETS, "gpt2", "vocab.json")
MERGES = os.path.join(ASSETS, "gpt2", "merges.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="reuse this jsonl corpus (built when missing)")
    parser.add_argument("--megabytes", type=float, default=20.0, help="corpus size to build")
    args = parser.parse_args()
    ctx = context()
    with tempfile.TemporaryDirectory() as folder:
        corpus = args.corpus or os.path.join(folder, "docstrings.jsonl")
        if not os.path.exists(corpus):
            write_docstring_corpus(corpus, int(args.megabytes * 2**20))
        megabytes = os.path.getsize(corpus) / 2**20
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]

        tokenizer = GPT2BPETokenizer(VOCAB, MERGES)
        start = time.perf_counter()
        bare_tokens = sum(len(tokenizer.tokenize(t)) for t in texts)
        bare_rate = bare_tokens / (time.perf_counter() - start)

        rates = {}
        for workers in (1, 2):
            prefix = os.path.join(folder, f"w{workers}")
            command = [
                "preprocess", "--input", corpus, "--output-prefix", prefix,
                "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB,
                "--merge-file", MERGES, "--json-keys", "text", "--append-eod",
                "--workers", str(workers), "--log-interval", "1000000000",
            ]  # fmt: skip
            start = time.perf_counter()
            if mp_data_main(command) != 0:
                raise SystemExit(f"mp-data {' '.join(command)} failed")
            seconds = time.perf_counter() - start
            written = IndexedDataset(prefix + "_text_document")
            tokens = int(written.sequence_lengths.sum())
            rates[workers] = tokens / seconds
            if tokens != bare_tokens + len(written):  # + one eod per document
                raise SystemExit(f"workers={workers} wrote {tokens} tokens, expected more")

    common = {"corpus_mb": round(megabytes, 1), "documents": len(texts), "tokens": bare_tokens}
    emit(
        "preprocess_tokens_per_s[workers=1]",
        {**common, "tokens_per_s": round(rates[1]), "baseline": "bare GPT-2 tokenizer, 1 thread",
         "baseline_tokens_per_s": round(bare_rate), "ratio": round(rates[1] / bare_rate, 3),
         "target_ratio": 0.8, "meets_target": rates[1] / bare_rate >= 0.8},
        ctx,
    )  # fmt: skip
    emit(
        "preprocess_tokens_per_s[workers=2]",
        {**common, "tokens_per_s": round(rates[2]), "baseline": "preprocess --workers 1",
         "baseline_tokens_per_s": round(rates[1]), "ratio": round(rates[2] / rates[1], 3),
         "target_ratio": 1.6, "meets_target": rates[2] / rates[1] >= 1.6},
        ctx,
    )  # fmt: skip


if __name__ == "__main__":
    main()
