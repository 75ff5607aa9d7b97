"""Benchmark: what attention sinks and a sliding window cost, side by side with plain
causal attention, on each core attention path.

One process, all cores. For each shape and dtype, `CoreAttention` forward and backward
with softmax_type "vanilla" (the baseline) and "learnable", without and with a window
of 127 earlier keys (gpt-oss's 128), through backend "flash" (SDPA, or banded_attention
with sinks or a window) and "local" (the blocked matmuls); the variants take turns; the
fastest of `--repeats` timed calls each, and each one's ratio to the baseline of its
backend.

    uv run python ci/bench/bench_attention_variants.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from harness import context, emit

from mp_layers.transformer.core_attention import CoreAttention

SHAPES = [(512, 4, 8, 4, 64), (2048, 1, 8, 4, 64), (4096, 1, 8, 4, 64)]  # s, b, nq, ng, d
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {  # name: (softmax_type, window)
    "vanilla": ("vanilla", None),
    "sinks": ("learnable", None),
    "window": ("vanilla", 127),
    "sinks_window": ("learnable", 127),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ctx = context()
    for name, dtype in DTYPES.items():
        for shape in SHAPES:
            for backend in ("flash", "local"):
                result = _measure(shape, dtype, backend, args.repeats)
                emit(f"attention_variants[{name},{backend}]", result, ctx)


def _measure(shape: tuple[int, ...], dtype: torch.dtype, backend: str, repeats: int) -> dict:
    s, b, nq, ng, d = shape
    torch.manual_seed(0)
    fused = torch.randn(s, b, ng, nq // ng + 2, d, dtype=dtype, requires_grad=True)
    grad = torch.randn(s, b, nq * d, dtype=dtype)
    modules = {
        name: CoreAttention(0.0, None, backend, softmax_type=kind, window=window, heads=nq,
                            params_dtype=dtype)
        for name, (kind, window) in VARIANTS.items()
    }  # fmt: skip

    def step(attention: CoreAttention) -> float:
        start = time.perf_counter()
        q = fused[:, :, :, : nq // ng].reshape(s, b, nq, d)
        attention(q, fused[:, :, :, nq // ng], fused[:, :, :, nq // ng + 1]).backward(grad)
        fused.grad = None
        return time.perf_counter() - start

    for attention in modules.values():  # warm-up
        step(attention)
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(repeats):
        for name, attention in modules.items():
            times[name].append(step(attention))
    best = {name: min(t) for name, t in times.items()}
    result = {"s": s, "b": b, "heads": nq, "query_groups": ng, "head_dim": d,
              "backend": backend, "repeats": repeats}  # fmt: skip
    for name, seconds in best.items():
        result[f"{name}_ms"] = round(seconds * 1e3, 1)
        if name != "vanilla":
            result[f"{name}_over_vanilla"] = round(seconds / best["vanilla"], 2)
    return result


if __name__ == "__main__":
    main()
