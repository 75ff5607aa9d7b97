"""Benchmark: how much of ZeRO-3's collectives overlaps compute, and in which order FSDP
issues them, with and without --overlap-param-gather, at DP2 on CPU ranks over gloo.

Two forked ranks (mp_state.testing.run_on_ranks, one compute thread each), each holding
every side, built the way a run builds them (`mp_train.parse_config` of Megatron flags,
`setup_run` with apps/gpt's model provider; bench_fsdp.py's helpers), from the same seed:

    side            beside ZeRO-3 (--use-megatron-fsdp, optim_grads_params)
    plain           (nothing): each layer all-gathers its parameters at its own forward
    prefetch        --overlap-grad-reduce --overlap-param-gather: each layer's forward
                    first starts the next layer's all-gather (FSDP2's explicit prefetch),
                    and on the CPU the all-gathers FSDP2 issues before a forward or a
                    backward are asynchronous (async_op=True, mp_optim.fsdp sets FSDP2's
                    `_set_unshard_async_op`), waited for at the layer that needs them
    prefetch_sync   as prefetch, with FSDP2's all-gathers synchronous again
                    (`_set_unshard_async_op(False)`, FSDP2's default, what a GPU uses):
                    the prefetch order without the overlap

A Llama-shaped model (default: hidden 512, 4 layers, 8 heads in 4 query groups of 64
channels, ffn 1376, SwiGLU, RMSNorm, RoPE, untied embeddings, vocabulary 8,000 padded to
8,064: 19,862,016 parameters), sequence 256, micro-batch 2 per rank, bf16 (fp32 shards,
bf16 gathered for compute, fp32 gradient reduction). A step is the loop's: zero_grad,
the no-pipelining schedule over one micro-batch of random tokens, optimizer.step(),
scheduler.step().

Correctness first: every side's first step (the same batch) must give the same loss and
gradient norm, or the run stops. Step time: after `--warmup` untimed steps each, the
sides take turns for `--iters` timed steps (harness.take_turns: a barrier before each,
the order flipped every round), timed on rank 0; best and median of each side, and
their ratio to plain's.

Overlap: then `--profiled` more steps of each side, in turns, with torch.profiler (CPU
activities) on rank 0 around each one. fsdp_trace.py reads each trace: every FSDP
all-gather (forward and backward) and gradient reduction (on the CPU an all-reduce,
mp_optim.fsdp_sharding's stand-in for the reduce-scatter), its interval on the gloo
thread that ran it, and the part of that interval during which the main thread ran
aten operators (compute; the waits and the hand-over to gloo left out). Per side and
role: the collectives' seconds per step, the overlapped seconds, their ratio (the
overlapped fraction), for the all-gathers also over the prefetched ones alone; the
step's loss and norm reductions are counted apart ("other"). The order checks
(fsdp_trace._order): whether each layer's successor's all-gather was issued before the
layer's forward ended, or at the successor's own pre-forward; in backward, whether a
layer's gradient reduction was issued before the previous layer's backward was done,
and the previous layer's all-gather before this layer's backward was done. Beside them,
per rank, what each kind of thread did during a profiled step (Linux's
/proc/self/task/*/schedstat): seconds on a core and seconds runnable but waiting for
one, for the main thread, gloo's collective workers and gloo's TCP transport loops.
Profiling slows rank 0, so the profiled steps are not the timed ones.

    uv run python ci/bench/bench_fsdp_overlap.py [--layers 4 --hidden 512 --iters 12
        --profiled 3] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from bench_fsdp import LEVELS, run_argv, side_runs, teardown
from fsdp_trace import detail, events_of, read_step, summarize
from harness import LlamaShape, context, emit, take_turns

from mp_state.testing import run_on_ranks

OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
SIDES = {"plain": [], "prefetch": OVERLAP, "prefetch_sync": OVERLAP}
"""Each side's flags beside ZeRO-3; prefetch_sync turns FSDP2's unshard_async_op off."""
TINY = LlamaShape(hidden=128, layers=3, heads=4, query_groups=2, head_dim=32, ffn=352,
                  vocab=1000)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--iters", type=int, default=12, help="timed steps per side")
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps per side")
    parser.add_argument("--tiny", action="store_true", help="a 3-layer toy: a quick check")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the launch")
    args = parser.parse_args()
    shape = TINY if args.tiny else LlamaShape(
        hidden=args.hidden, layers=args.layers, heads=args.hidden // 64, query_groups=4,
        head_dim=64, ffn=args.ffn, vocab=args.vocab,
    )  # fmt: skip
    argv = run_argv(shape, "bf16", args.seq, args.batch, 2) + LEVELS["zero3"]
    load_before = round(os.getloadavg()[0], 2)
    rank0, rank1 = run_on_ranks(_rank, 2, argv, args, timeout=args.timeout)
    load = {"load_1min_before": load_before, "load_1min_after": round(os.getloadavg()[0], 2)}
    times = rank0["times"]
    best = {side: min(t) for side, t in times.items()}
    median = {side: statistics.median(t) for side, t in times.items()}
    figures = {
        "step_s_best": {side: round(s, 4) for side, s in best.items()},
        "step_s_median": {side: round(s, 4) for side, s in median.items()},
        "step_ratio_to_plain_best": {s: round(best[s] / best["plain"], 3) for s in best},
        "step_ratio_to_plain_median": {s: round(median[s] / median["plain"], 3) for s in median},
        "overlap": rank0["overlap"],
        "thread_times_per_step": {"rank0": rank0["threads"], "rank1": rank1["threads"]},
        "step_s": {side: [round(x, 4) for x in t] for side, t in times.items()},
        "first_step": rank0["first_step"],
        "parameters": rank0["parameters"],
        "dp": 2,
        "hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads,
        "query_groups": shape.query_groups, "ffn": shape.ffn, "vocab": shape.vocab,
        "sequence_length": args.seq, "micro_batch_per_rank": args.batch,
        "precision": "bf16 (fp32 shards, bf16 gathered, fp32 gradient reduction)",
        "warmup_steps": args.warmup, "timed_steps": args.iters,
        "profiled_steps": args.profiled, "threads_per_rank": 1,
        **load,
    }  # fmt: skip
    emit("fsdp_overlap[zero3,dp=2]", figures, context())


def _rank(argv: list[str], args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    runs, steps, rank = side_runs(argv, SIDES)
    for chunk in runs["prefetch_sync"].model:
        # FSDP2's switch (private in torch 2.15) for issuing the pre-forward and
        # pre-backward all-gathers with async_op=True, which mp sets on the CPU.
        if not hasattr(chunk.module, "_set_unshard_async_op"):
            raise RuntimeError(f"torch {torch.__version__}'s FSDP2 has no unshard_async_op")
        chunk.module._set_unshard_async_op(False)
    first = {side: step() for side, step in steps.items()}  # the same first batch
    if len(set(first.values())) != 1:
        raise RuntimeError(
            f"rank {rank}: the sides' first steps (loss, gradient norm) differ: {first}: they "
            "do not do the same work"
        )
    times = take_turns(steps, args.warmup, args.iters)
    traces: dict[str, list] = {side: [] for side in steps}
    threads: dict[str, list] = {side: [] for side in steps}
    order = list(steps)
    for _ in range(args.profiled):
        for side in order:
            dist.barrier()
            before = _schedstat()
            if rank == 0:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    steps[side]()
            else:
                steps[side]()
            threads[side].append(_thread_times(before, _schedstat()))
            if rank == 0:
                traces[side].append(read_step(events_of(prof)))
        order.reverse()
    parameters = sum(p.numel() for chunk in runs["plain"].model for p in chunk.module.parameters())
    teardown()
    overlap = {}
    for side, steps_read in traces.items():
        if steps_read:
            overlap[side] = {**summarize(steps_read), "last_step": detail(steps_read[-1])}
    return {
        "times": times,
        "overlap": overlap,
        "threads": {side: _median_times(t) for side, t in threads.items()},
        "first_step": {"loss": first["plain"][0], "grad_norm": first["plain"][1]},
        "parameters": parameters,
    }


def _schedstat() -> dict[int, tuple[str, int, int]]:
    """This process's threads: tid -> (name, ns run on a core, ns runnable but waiting
    for one) from Linux's /proc/self/task/*/schedstat."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran, waited = (int(x) for x in f.read().split()[:2])
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        found[int(task)] = (name, ran, waited)
    return found


_THREADS = {"gloo_workers": "pt_gloo", "gloo_transport": "gloo_tcp"}


def _thread_times(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Seconds run and waited for a core between two _schedstat()s, per kind of thread:
    the main thread, gloo's collective workers (pt_gloo_runloop), gloo's TCP transport
    loops (gloo_tcp_loop), the rest (autograd's, the profiler's)."""
    kinds = {k: {"run_s": 0.0, "runqueue_wait_s": 0.0} for k in ("main", *_THREADS, "other")}
    for tid, (name, ran, waited) in after.items():
        _, ran0, waited0 = before.get(tid, (name, 0, 0))
        kind = next((k for k, prefix in _THREADS.items() if name.startswith(prefix)), "other")
        kind = "main" if tid == os.getpid() else kind
        kinds[kind]["run_s"] += (ran - ran0) / 1e9
        kinds[kind]["runqueue_wait_s"] += (waited - waited0) / 1e9
    return kinds


def _median_times(per_step: list[dict]) -> dict:
    return {
        kind: {key: round(statistics.median(s[kind][key] for s in per_step), 4)
               for key in per_step[0][kind]}
        for kind in per_step[0]
    }  # fmt: skip


if __name__ == "__main__":
    main()
