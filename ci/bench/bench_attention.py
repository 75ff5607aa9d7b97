"""Benchmark: core attention's backends side by side, and whether "auto" picks the faster.

One process, all cores. For each shape (sequence s, batch b, query heads nq,
key/value heads ng, head channels d) and dtype, `CoreAttention` forward and
backward under the causal mask, through SDPA (backend "flash") and through the
blocked matmuls ("local"), the two taking turns; the fastest and the median of
`--repeats` timed calls each. The inputs are slices of one fused QKV tensor
[s, b, ng, nq / ng + 2, d], as SelfAttention hands them over. Each line names
the backend that "auto" takes for the shape, the probabilities the blocked path
keeps (mp_layers.transformer.blocked_attention.saved_probability_bytes), and
whether auto's pick was the faster of the two (by the fastest call).

    uv run python ci/bench/bench_attention.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness import context, emit

from mp_layers.transformer.blocked_attention import saved_probability_bytes
from mp_layers.transformer.core_attention import AUTO_BLOCKED_LIMIT_BYTES, CoreAttention

SHAPES = [  # s, b, nq, ng, d
    (512, 4, 8, 4, 64),  # bench_layers.py / bench_gpt.py
    (256, 4, 8, 8, 64),
    (1024, 1, 8, 2, 128),
    (1024, 2, 16, 16, 64),
    (2048, 1, 8, 4, 64),
    (2048, 1, 16, 4, 128),
    (2048, 4, 8, 4, 64),
    (4096, 1, 8, 4, 64),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per backend")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ctx = context()
    for name, dtype in DTYPES.items():
        for shape in SHAPES:
            emit(f"core_attention[{name}]", _measure(shape, dtype, args.repeats), ctx)


def _measure(shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict:
    s, b, nq, ng, d = shape
    torch.manual_seed(0)
    fused = torch.randn(s, b, ng, nq // ng + 2, d, dtype=dtype, requires_grad=True)
    grad = torch.randn(s, b, nq * d, dtype=dtype)
    backends = {
        "sdpa": CoreAttention(0.0, None, "flash"),
        "blocked": CoreAttention(0.0, None, "local"),
    }

    def step(attention: CoreAttention) -> float:
        start = time.perf_counter()
        q = fused[:, :, :, : nq // ng].reshape(s, b, nq, d)
        attention(q, fused[:, :, :, nq // ng], fused[:, :, :, nq // ng + 1]).backward(grad)
        fused.grad = None
        return time.perf_counter() - start

    for attention in backends.values():  # warm-up
        step(attention)
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(repeats):
        for name, attention in backends.items():
            times[name].append(step(attention))
    best = {name: min(t) for name, t in times.items()}
    q = torch.empty(s, b, nq, d, dtype=dtype)
    auto = "blocked" if CoreAttention(0.0, None, "auto").uses_blocked(q) else "sdpa"
    faster = min(best, key=best.get)
    saved = saved_probability_bytes(s, b, nq, q.element_size())
    return {
        "s": s, "b": b, "heads": nq, "query_groups": ng, "head_dim": d,
        "sdpa_ms": round(best["sdpa"] * 1e3, 1),
        "blocked_ms": round(best["blocked"] * 1e3, 1),
        "sdpa_ms_median": round(statistics.median(times["sdpa"]) * 1e3, 1),
        "blocked_ms_median": round(statistics.median(times["blocked"]) * 1e3, 1),
        "sdpa_over_blocked": round(best["sdpa"] / best["blocked"], 2),
        "blocked_saved_mib": round(saved / 2**20, 1),
        "auto_limit_mib": AUTO_BLOCKED_LIMIT_BYTES[dtype] / 2**20,
        "auto_takes": auto, "faster": faster, "auto_took_the_faster": auto == faster,
        "repeats": repeats,
    }  # fmt: skip


if __name__ == "__main__":
    main()
