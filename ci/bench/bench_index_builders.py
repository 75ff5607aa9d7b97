"""Benchmark: the native sample index builder against its numpy reference.

A GPT dataset of 1M documents and ~200M tokens (lengths drawn from an
exponential of mean 200), sequence length 2048, 1 and 3 epochs; the document
index is built as Megatron's GPTDataset builds it (the epochs' ids shuffled by
numpy.random.RandomState). Each measure times mp_data.index_builders (the
wrapper users call, argument checks included) and mp_data.index_reference on
the same inputs, best of --repeats, checks that they agree, and prints one JSON
line with the ratio (reference / native: how many times faster native is).

    uv run python ci/bench/bench_index_builders.py
"""

from __future__ import annotations

import argparse

import numpy as np
from harness import best_of, context, emit

from mp_data import index_builders, index_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--mean-length", type=float, default=200.0)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(1234)
    sizes = np.ceil(rng.exponential(args.mean_length, args.documents)).astype(np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    ctx = context()
    for epochs in args.epochs:
        document_index = np.tile(np.arange(args.documents, dtype=np.int32), epochs)
        np.random.RandomState(1234).shuffle(document_index)
        call = (sizes, document_index, args.sequence_length, epochs, tokens_per_epoch)
        native_s, native = best_of(args.repeats, index_builders.build_sample_idx, *call)
        reference_s, reference = best_of(args.repeats, index_reference.build_sample_idx, *call)
        if not np.array_equal(native, reference):
            raise SystemExit(f"native and reference sample indices differ at {epochs} epoch(s)")
        figures = {
            "documents": args.documents,
            "tokens_per_epoch": tokens_per_epoch,
            "epochs": epochs,
            "sequence_length": args.sequence_length,
            "samples": len(native) - 1,
            "native_s": round(native_s, 6),
            "baseline": "mp_data.index_reference (numpy)",
            "baseline_s": round(reference_s, 6),
            "ratio": round(reference_s / native_s, 2),
        }
        emit("build_sample_idx", figures, ctx)


if __name__ == "__main__":
    main()
