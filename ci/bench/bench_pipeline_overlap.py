"""Benchmark: the interleaved schedule's exchanges overlapped with compute, beside waited.

p ranks (2 and 4), forked by mp_state.testing.run_on_ranks over gloo, one thread
each, run mp_pipeline's interleaved schedule (v = 2 model chunks per rank) on m = 8
micro-batches in three ways, taking turns within one launch (harness.take_turns,
the order flipped every round):

- waited: each exchange waited for as it is posted (overlap_p2p_comm=False,
  `--no-overlap-p2p-communication`);
- overlap: the steady state's exchanges in flight while the other direction's step
  computes (overlap_p2p_comm=True, Megatron-LM's and mp's training default);
- warmup_flush: the warm-up's and the flush's too (overlap_p2p_comm_warmup_flush).

The stage is bench_pipeline.py's: x + bias through an autograd function that sleeps t
in its forward and t in its backward, standing for a device kernel, so that the CPU
is free for gloo's transfers as a GPU's copy engines are beside its kernels. What
overlap can hide is the transfer: the boundary tensors are [s, b, h] = [1024, 1, 4096]
fp32 (16 MiB, a 4096-wide model's micro-batch of 1,024 tokens, or 2,048 in bf16), whose
one-way trip through gloo over loopback TCP is measured too (`transfer_ms`). A
rank's compute is v m 2t; the pipeline's ideal step (v m + p - 1) 2t, with nothing
for the transfers.

Each side runs once untimed, then `--repeats` times; the figures are each side's
best and median step (the longest rank's), and the ratios waited / overlap.

    uv run python ci/bench/bench_pipeline_overlap.py    # about 90 seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time

import torch
from bench_pipeline import _Clock, _forward_step, _Stage
from harness import context, emit, take_turns

import mp_state
from mp_pipeline import P2PCommunicator, PipelineConfig, get_forward_backward_func
from mp_state.testing import run_on_ranks

SEQ, MICRO_BATCH, HIDDEN = 1024, 1, 4096
VPP, MICROBATCHES = 2, 8
SIDES = {
    "waited": {},
    "overlap": {"overlap_p2p_comm": True},
    "warmup_flush": {"overlap_p2p_comm": True, "overlap_p2p_comm_warmup_flush": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-ms", type=float, default=50.0,
                        help="one chunk's forward (and backward) time, ms")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = parser.parse_args()
    ctx = context()
    t = args.t_ms / 1000
    for p in args.sizes:
        per_rank = run_on_ranks(_rank, p, p, t, args.repeats, timeout=args.timeout)
        steps = {side: [max(run) for run in zip(*(r["steps"][side] for r in per_rank),
                                                  strict=True)]
                 for side in SIDES}  # fmt: skip
        best = {side: min(times) for side, times in steps.items()}
        median = {side: statistics.median(times) for side, times in steps.items()}
        ideal = (VPP * MICROBATCHES + p - 1) * 2 * t
        emit(f"pipeline_overlap[p={p},v={VPP},m={MICROBATCHES}]", {
            "t_ms": args.t_ms, "boundary_shape_sbh": [SEQ, MICRO_BATCH, HIDDEN],
            "transfer_ms": round(per_rank[1]["transfer_ms"], 2),
            "ideal_step_s": round(ideal, 4),
            **{f"{side}_best_s": round(best[side], 4) for side in SIDES},
            **{f"{side}_median_s": round(median[side], 4) for side in SIDES},
            "speedup_overlap_best": round(best["waited"] / best["overlap"], 3),
            "speedup_overlap_median": round(median["waited"] / median["overlap"], 3),
            "speedup_warmup_flush_best": round(best["waited"] / best["warmup_flush"], 3),
            "speedup_warmup_flush_median": round(median["waited"] / median["warmup_flush"], 3),
            "repeats": args.repeats, "threads_per_rank": 1,
        }, ctx)  # fmt: skip


def _rank(p: int, t: float, repeats: int) -> dict:
    """This rank's step times per side, and the median one-way time of one transfer."""
    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig(pipeline_model_parallel_size=p))
    r = state.pp.rank
    clock = _Clock(t)
    x_sbh = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))
    chunks = [_Stage(clock, first=r == 0 and c == 0, hidden=HIDDEN) for c in range(VPP)]
    schedule = get_forward_backward_func(p, VPP)
    base = PipelineConfig(seq_length=SEQ, micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN)

    def step(settings: dict) -> None:
        schedule(
            forward_step_func=_forward_step,
            data_iterator=[itertools.repeat(x_sbh) for _ in chunks], model=chunks,
            num_microbatches=MICROBATCHES, config=dataclasses.replace(base, **settings),
            pp_group=state.pp,
        )  # fmt: skip

    steps = take_turns({side: lambda s=settings: step(s) for side, settings in SIDES.items()},
                       warmup=1, repeats=repeats)  # fmt: skip
    pair = torch.distributed.new_group([0, 1])  # every rank takes part in making it
    transfer_ms = _transfer_ms(state, pair, x_sbh) if r < 2 else 0.0
    mp_state.destroy()
    return {"steps": steps, "transfer_ms": transfer_ms}


def _transfer_ms(state, pair, x_sbh: torch.Tensor, samples: int = 10) -> float:
    """Rank 0 sends a boundary tensor to rank 1 `samples` times, each after a barrier of
    the two; rank 1's median time from the barrier to holding it, in ms."""
    comm = P2PCommunicator(state.pp, tuple(x_sbh.shape), x_sbh.dtype)
    times = []
    for _ in range(samples + 1):
        torch.distributed.barrier(group=pair)
        start = time.perf_counter()
        if state.pp.rank == 0:
            comm.send_forward(x_sbh)
        else:
            comm.recv_forward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


if __name__ == "__main__":
    main()
