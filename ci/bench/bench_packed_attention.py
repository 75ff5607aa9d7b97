"""Benchmark: attention over packed documents without an s x s mask, beside the dense mask.

One process, all cores. A sample of `--seq` positions (16,384) packs `--documents`
documents (64, of random lengths summing to the sequence, seed 0); core attention
(CoreAttention, SDPA backend, fp32, b 1, 4 query heads sharing 2 key/value heads of 64
channels) runs forward and backward two ways, taking turns:

- dense: the [1, 1, s, s] boolean mask that keeps documents apart (what the samples
  carried before packed attention), built inside the measured call as the data loader
  built it for every sample;
- packed: a PackedSeqParams of the same documents (each document attended on its own).

For each: the peak bytes of CPU tensors held at once during the call (torch's profiler,
every allocation and free), and the best and median of `--repeats` calls' time. The
outputs and input gradients of the two ways are compared (they must agree). Target:
packed peak <= 0.1x dense.

    uv run python ci/bench/bench_packed_attention.py [--seq 16384] [--documents 64]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import numpy as np
import torch
from harness import context, emit

from mp_layers import PackedSeqParams
from mp_layers.transformer.core_attention import CoreAttention

NQ, NG, D = 4, 2, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    s = args.seq
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, s), args.documents - 1, replace=False))
    ids = torch.from_numpy(np.searchsorted(cuts, np.arange(s), side="right"))[None]
    torch.manual_seed(0)
    q = torch.randn(s, 1, NQ, D, requires_grad=True)
    k = torch.randn(s, 1, NG, D, requires_grad=True)
    v = torch.randn(s, 1, NG, D, requires_grad=True)
    grad = torch.randn(s, 1, NQ * D)
    attention = CoreAttention(0.0, None, "flash")

    def dense():
        document = ids[0]
        allowed = torch.ones(s, s, dtype=torch.bool).tril_()
        allowed &= document[:, None] == document[None, :]
        return attention(q, k, v, (~allowed)[None, None])

    def packed():
        return attention(q, k, v, PackedSeqParams.from_document_ids(ids))

    runs = {"dense": dense, "packed": packed}
    results = {name: run_once(fn, grad, q, k, v) for name, fn in runs.items()}
    for got, want in zip(results["packed"], results["dense"], strict=True):  # the same either way
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    times = {name: [] for name in runs}
    peaks = {}
    for name, fn in runs.items():
        peaks[name] = peak_bytes(functools.partial(run_once, fn, grad, q, k, v))
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            run_once(fn, grad, q, k, v)
            times[name].append(time.perf_counter() - start)
    figures = {"seq": s, "documents": args.documents, "longest_document": int(
        torch.bincount(ids[0]).max())}  # fmt: skip
    for name in runs:
        figures[f"{name}_peak_mib"] = round(peaks[name] / 2**20, 1)
        figures[f"{name}_best_s"] = round(min(times[name]), 4)
        figures[f"{name}_median_s"] = round(statistics.median(times[name]), 4)
    figures["peak_ratio"] = round(peaks["packed"] / peaks["dense"], 4)
    figures["speedup_best"] = round(min(times["dense"]) / min(times["packed"]), 2)
    emit("packed_attention[fp32]", figures, context())


def run_once(fn, grad, *inputs):
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(grad)
    return [out.detach(), *(t.grad.clone() for t in inputs)]


def peak_bytes(fn) -> int:
    """The most bytes of CPU tensors held at once during fn() beyond those held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def change(event):  # an operator's own allocations; "[memory]" events are frees
        return event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage

    live = peak = 0
    for _, delta in sorted((e.time_range.start, change(e)) for e in prof.events()):
        live += delta
        peak = max(peak, live)
    return peak


if __name__ == "__main__":
    main()
