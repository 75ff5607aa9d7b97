"""Benchmark: how long mp_gpt.generate's Generator takes to start on a checkpoint, with
its weights built undrawn before the checkpoint is loaded over them (skipping_draws,
what it does) beside drawn first (what it did), in one process taking turns.

The checkpoint: a transformers Llama of the shape below (random weights, saved, then
imported by `mp-ckpt import-hf`, as bench_generate does). Each round starts one
Generator of each kind (the order swapped every round), times its construction
(building the model, loading the checkpoint) and closes it; a first round of each is
not timed. Both must then continue a prompt with the same greedy tokens.

    uv run python ci/bench/bench_generator_start.py [--hidden 1024] [--layers 16]
        [--ffn 2816] [--vocab 32000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import bench_generate
import torch
from harness import LlamaShape, context, emit

import mp_gpt.generate
from mp_gpt.generate import Generator
from mp_gpt.generation import Sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    heads = args.hidden // 64
    shape = LlamaShape(args.hidden, args.layers, heads, heads // 4, 64, args.ffn, args.vocab)
    with tempfile.TemporaryDirectory() as scratch:
        first, hf_model = bench_generate.model_pair(shape, 256, Path(scratch), "cpu")
        first.close()
        params = sum(p.numel() for p in hf_model.parameters())
        del hf_model
        load = str(Path(scratch) / "ckpt")
        times: dict[str, list[float]] = {"undrawn": [], "drawn": []}
        tokens: dict[str, list[int]] = {}
        for round_ in range(args.rounds + 1):
            sides = ["undrawn", "drawn"] if round_ % 2 == 0 else ["drawn", "undrawn"]
            for side in sides:
                seconds, tokens[side] = _start(load, side)
                if round_ > 0:
                    times[side].append(seconds)
    if tokens["undrawn"] != tokens["drawn"]:
        raise RuntimeError(f"the two generators continue differently: {tokens}")
    best = {side: min(t) for side, t in times.items()}
    median = {side: statistics.median(t) for side, t in times.items()}
    print(f"Generator start, {params / 1e6:.0f}M parameters: undrawn best {best['undrawn']:.2f} "
          f"s, median {median['undrawn']:.2f}; drawn best {best['drawn']:.2f} s, median "
          f"{median['drawn']:.2f}; drawn / undrawn {best['drawn'] / best['undrawn']:.2f}x best, "
          f"{median['drawn'] / median['undrawn']:.2f}x median")  # fmt: skip
    emit("generator_start", {
        "parameters": params, "seconds": times,
        "best_s": best, "median_s": median,
        "speedup_best": round(best["drawn"] / best["undrawn"], 3),
        "speedup_median": round(median["drawn"] / median["undrawn"], 3),
        "rounds": args.rounds, "shape": vars(args), "threads": torch.get_num_threads(),
    }, context())  # fmt: skip


def _start(load: str, side: str) -> tuple[float, list[int]]:
    """Seconds to construct a Generator on `load` (its weights undrawn, or drawn first as
    before), and its first 8 greedy tokens after a fixed prompt."""
    skip = mp_gpt.generate.skipping_draws
    if side == "drawn":
        mp_gpt.generate.skipping_draws = contextlib.nullcontext
    try:
        start = time.perf_counter()
        generator = Generator(load)
        seconds = time.perf_counter() - start
    finally:
        mp_gpt.generate.skipping_draws = skip
    try:
        [done] = generator.complete([[1, 2, 3, 4]], max_new_tokens=8,
                                    sampling=[Sampling(temperature=0.0)])  # fmt: skip
    finally:
        generator.close()
    return seconds, list(done.tokens)


if __name__ == "__main__":
    main()
