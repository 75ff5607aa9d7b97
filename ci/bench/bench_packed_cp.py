"""Benchmark: packed documents under context parallelism, split by sample against split
by document, side by side on the same documents.

CP2 on two ranks (gloo, one thread each), the ring (`--cp-comm-type p2p`), core
attention only: `context_parallel_attention` forward and backward, bf16, b 1, 8 query
heads sharing 4 key/value heads of 64 channels, over a sample of `--seq` positions
(8,192) packing documents of one of two mixes (seed 0):

- sft: conversations of 50 to 550 tokens (300 on average), each padded to a multiple of
  2 x cp (as mp's SFT samples are under context parallelism), then trailing padding;
- long: one document of 5/8 of the sample, one of 1/4, one of 1/8 (all multiples of
  2 x cp).

Every document divides into 2 x cp chunks, so both splits apply to the same sample:

- sample: each rank holds chunks r and 2cp-1-r of the whole sample and every block of
  the ring is masked to the pairs within one document (a block no document spans is
  skipped): mp's split for documents cut anywhere;
- document: each rank holds chunks r and 2cp-1-r of every document, and each block is
  computed document by document (Megatron's split for packed sequences; mp's whenever
  the documents allow, mp_layers.PackedSeqParams).

They take turns (harness.take_turns: a barrier before each call, the order flipped every
round); a call's time is the slower rank's. Figures: best and median seconds of each,
the ratio, and each rank's median (how even the ranks' work is). The two must compute
the same attention: the sum over both ranks of output x a fixed per-position weight is
compared.

    uv run python ci/bench/bench_packed_cp.py [--seq 8192] [--mix sft long] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch
import torch.distributed as dist
from harness import context, emit, take_turns

from mp_layers import PackedSeqParams
from mp_layers.context_parallel import context_parallel_attention, shard_sequence
from mp_state.testing import run_on_ranks

NQ, NG, D, CP = 8, 4, 64, 2


def lengths_of(mix: str, seq: int) -> list[int]:
    multiple = 2 * CP
    if mix == "long":
        return [5 * seq // 8, seq // 4, seq // 8]
    rng = np.random.default_rng(0)
    lengths, used = [], 0
    while True:
        n = -(-int(rng.integers(50, 551)) // multiple) * multiple
        if used + n > seq:
            break
        lengths.append(n)
        used += n
    return [*lengths, seq - used] if used < seq else lengths


def _rank(seq: int, mix: str, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    import mp_state

    state = mp_state.initialize(mp_state.ParallelConfig(context_parallel_size=CP))
    group = state.cp
    lengths = lengths_of(mix, seq)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, NQ, D, generator=generator).bfloat16()
    k, v = (torch.randn(seq, 1, NG, D, generator=generator).bfloat16() for _ in range(2))
    weight = torch.randn(seq, 1, NQ * D, generator=generator)
    packed = PackedSeqParams.from_document_ids(ids, CP, group.rank)
    assert packed.split == "document"

    sides = {
        "sample": ([shard_sequence(t, CP, group.rank, dim=0) for t in (q, k, v, weight)],
                   {"documents": ids}),
        "document": ([_local(packed, t, group.rank) for t in (q, k, v, weight)],
                     {"document_chunks": packed.chunk_segments}),
    }  # fmt: skip
    checks, steps = {}, {}
    for name, (local, kwargs) in sides.items():
        inputs = [t.clone().requires_grad_() for t in local[:3]]

        def step(inputs=inputs, kwargs=kwargs, local=local):
            for t in inputs:
                t.grad = None
            out = context_parallel_attention(*inputs, group, scale=1 / math.sqrt(D),
                                             comm_type="p2p", **kwargs)  # fmt: skip
            out.backward(local[3].to(out.dtype))
            return out

        total = (step().float() * local[3]).sum()
        dist.all_reduce(total, group=group.group)
        checks[name] = total.item()
        steps[name] = step
    times = take_turns(steps, warmup, repeats)
    return {"times": times, "checks": checks, "lengths": lengths}


def _local(packed: PackedSeqParams, t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows of t [S, b, ...] split by document."""
    rows = packed.order[0].to(t.device)
    return shard_sequence(t[rows], CP, rank, dim=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mix", nargs="+", default=["sft", "long"], choices=["sft", "long"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    for mix in args.mix:
        ranks = run_on_ranks(_rank, CP, args.seq, mix, args.warmup, args.repeats,
                             timeout=args.timeout, start_method="spawn")  # fmt: skip
        checks = ranks[0]["checks"]
        if not math.isclose(checks["sample"], checks["document"], rel_tol=1e-2, abs_tol=1e-2):
            raise SystemExit(f"the two splits disagree: {checks}")
        lengths = ranks[0]["lengths"]
        figures = {"mix": mix, "seq": args.seq, "cp": CP, "documents": len(lengths),
                   "longest_document": max(lengths)}  # fmt: skip
        for name in ("sample", "document"):
            slowest = [max(t) for t in zip(*(r["times"][name] for r in ranks), strict=True)]
            figures[f"{name}_best_s"] = round(min(slowest), 4)
            figures[f"{name}_median_s"] = round(statistics.median(slowest), 4)
            figures[f"{name}_rank_medians_s"] = [
                round(statistics.median(r["times"][name]), 4) for r in ranks
            ]
        figures["speedup_best"] = round(figures["sample_best_s"] / figures["document_best_s"], 2)
        figures["speedup_median"] = round(
            figures["sample_median_s"] / figures["document_median_s"], 2
        )
        emit("packed_context_parallel[bf16]", figures, context())


if __name__ == "__main__":
    main()
