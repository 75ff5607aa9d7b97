"""Benchmark: context parallelism, CP2 over a p2p ring on 2 ranks against one rank using
both cores, side by side: tokens/s, peak memory per rank, the ring's exposed waits.

The model is the Llama-style shape of bench_gpt.py (hidden 512, 8 layers, 8 heads in 4
query groups of 64 channels, ffn 1376, SwiGLU, RMSNorm, RoPE, vocabulary 32,000 (a
multiple of 128: not padded), dropout 0; about 56M parameters), trained in bf16 (bf16
parameters, fp32 gradients and main parameters, Megatron's mixed precision) on mock data,
micro-batch 1 = global batch, at each sequence length asked for.

Both runs are apps/gpt's real training loop (`mp_gpt.pretrain.train` of Megatron flags),
each in fresh processes started for the measurement (mp_state.testing.run_on_ranks,
spawn, a gloo world):

- one rank: one process, torch.set_num_threads(2);
- CP2: two processes, one thread each, `--context-parallel-size 2 --cp-comm-type p2p`:
  each rank holds two of the four load-balanced chunks of every sequence (half the
  tokens), k/v travel the ring, and the gradients are averaged over the two ranks (the
  dp x cp group) by the loop's DDP.

An iteration is the interval between two consecutive calls of the loop's forward step
(one micro-batch per iteration): get_batch, forward, loss, backward, the gradient
all-reduce, the optimizer step, the scheduler, the loop's logging. The first `--warmup`
iterations are untimed; tokens/s of a run is the sequence length over its iterations.
For CP2 an iteration lasts as long as its slower rank (each rank's intervals are taken;
the larger of the two per iteration counts).

Peak memory per rank: the process's resident set (Linux /proc/self/status). At the
start of each iteration the peak (VmHWM) is reset (`echo 5 > /proc/self/clear_refs`)
after malloc_trim(0) has handed freed heap back, and VmRSS is read; at the next one
VmHWM is read. `peak_growth_mib` = the iteration's peak - its starting RSS: what the step
allocates (activations, gradients of activations, logits, the loss, communication
buffers); `peak_rss_mib` is the whole process's peak (with the interpreter, torch, the
weights, their gradients and the optimizer's state, which CP does not divide). The
target is on the growth; the whole-process ratio stands beside it.

Exposed communication: `mp_layers.context_parallel.timed_ring_waits()` around the run
times every wait on a ring exchange (k/v in forward and backward, the k/v gradient
accumulators in backward): the transfer time not hidden behind the block computed
meanwhile, plus any wait for a late peer; per iteration, per rank. The gradient
all-reduce of DDP is not the ring's and is not in it.

The two take turns for `--rounds` rounds at each sequence length. Figures: best and
median tokens/s of each and their ratio, the median peak growth per rank and the ratio,
the exposed ring time per iteration. Targets: CP2 tokens/s >= 0.9x one rank's (best
against best), CP2 peak growth per rank <= 0.6x one rank's. The losses of the two runs
are printed side by side: the same samples, the same model, they must agree.

    uv run python ci/bench/bench_cp.py [--seq 8192 16384 --rounds 3 --warmup 2 --iters 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import LLAMA_SHAPE, context, emit, llama_flags, reset_peak_rss, status_mib

from mp_state.testing import run_on_ranks

HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = LLAMA_SHAPE
TARGET_TOKENS_RATIO = 0.9
TARGET_MEMORY_RATIO = 0.6
THREADS = os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192], help="sequence lengths")
    parser.add_argument("--rounds", type=int, default=3, help="turns of one rank, then CP2")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = parser.parse_args()
    ctx = context()
    for seq in args.seq:
        runs: dict[str, list[dict]] = {"one_rank": [], "cp2": []}
        for _ in range(args.rounds):
            runs["one_rank"].append(_measure(seq, 1, args))
            runs["cp2"].append(_measure(seq, 2, args))
        emit(f"context_parallel_train_iteration[bf16,s={seq}]", _figures(seq, runs, args), ctx)


def _figures(seq: int, runs: dict[str, list[dict]], args) -> dict:
    one, cp2 = runs["one_rank"], runs["cp2"]

    def seconds(measured: list[dict]) -> list[float]:
        return [t for run in measured for t in run["iteration_s"]]

    def growth(measured: list[dict]) -> list[float]:
        return [g for run in measured for g in run["peak_growth_mib"]]

    def peak(measured: list[dict]) -> list[float]:
        return [g for run in measured for g in run["peak_rss_mib"]]

    t1, t2 = seconds(one), seconds(cp2)
    tokens = {"one": seq / min(t1), "cp2": seq / min(t2)}
    median = {"one": seq / statistics.median(t1), "cp2": seq / statistics.median(t2)}
    g1, g2 = statistics.median(growth(one)), statistics.median(growth(cp2))
    p1, p2 = statistics.median(peak(one)), statistics.median(peak(cp2))
    waits = [w for run in cp2 for w in run["ring_wait_s"]]
    kv = [w for run in cp2 for w in run["ring_wait_kv_s"]]
    grad = [w for run in cp2 for w in run["ring_wait_grad_s"]]
    return {
        "sequence_length": seq,
        "tokens_per_s": round(tokens["cp2"], 1),
        "one_rank_tokens_per_s": round(tokens["one"], 1),
        "ratio": round(tokens["cp2"] / tokens["one"], 3),
        "tokens_per_s_median": round(median["cp2"], 1),
        "one_rank_tokens_per_s_median": round(median["one"], 1),
        "ratio_median": round(median["cp2"] / median["one"], 3),
        "target_ratio": TARGET_TOKENS_RATIO,
        "meets_tokens_target": tokens["cp2"] / tokens["one"] >= TARGET_TOKENS_RATIO,
        "peak_growth_mib_per_rank": round(g2, 1),
        "one_rank_peak_growth_mib": round(g1, 1),
        "peak_growth_ratio": round(g2 / g1, 3),
        "target_memory_ratio": TARGET_MEMORY_RATIO,
        "meets_memory_target": g2 / g1 <= TARGET_MEMORY_RATIO,
        "peak_rss_mib_per_rank": round(p2, 1),
        "one_rank_peak_rss_mib": round(p1, 1),
        "peak_rss_ratio": round(p2 / p1, 3),
        "ring_exposed_wait_ms_per_iteration": round(statistics.median(waits) * 1e3, 1),
        "ring_exposed_wait_ms_per_iteration_best": round(min(waits) * 1e3, 1),
        "ring_exposed_kv_wait_ms_median": round(statistics.median(kv) * 1e3, 1),
        "ring_exposed_grad_wait_ms_median": round(statistics.median(grad) * 1e3, 1),
        "ring_waits_per_iteration": cp2[0]["ring_waits_per_iteration"],
        "iteration_s": [round(t, 3) for t in t2],
        "one_rank_iteration_s": [round(t, 3) for t in t1],
        "peak_growth_mib": [round(g, 1) for g in growth(cp2)],
        "one_rank_peak_growth_mib_all": [round(g, 1) for g in growth(one)],
        "ring_wait_ms": [round(w * 1e3, 1) for w in waits],
        "losses": cp2[0]["losses"],
        "one_rank_losses": one[0]["losses"],
        "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "query_groups": GROUPS,
        "ffn": FFN, "vocab": VOCAB, "micro_batch": 1, "rounds": args.rounds,
        "warmup_per_run": args.warmup, "timed_per_run": args.iters,
        "one_rank_threads": THREADS, "cp2_threads_per_rank": 1, "cp_comm_type": "p2p",
        "precision": "bf16 parameters, fp32 gradients and main parameters (both)",
        "memory_method": "per iteration: VmHWM (reset by /proc/self/clear_refs 5 after "
        "malloc_trim at the iteration's start) - VmRSS at its start; medians, per rank",
        "ring_wait_method": "mp_layers.context_parallel.timed_ring_waits: time in the ring "
        "exchanges' request.wait(), per iteration, per rank; the larger rank's",
    }  # fmt: skip


def _measure(seq: int, cp: int, args) -> dict:
    """One run in fresh processes: per timed iteration, its seconds (the slower rank's),
    the peak memory per rank (the larger rank's), the ring's waits; the losses."""
    with tempfile.TemporaryDirectory() as scratch:
        metrics = f"{scratch}/metrics.jsonl"
        argv = _argv(seq, cp, args.warmup + args.iters + 1, metrics)
        threads = THREADS if cp == 1 else 1
        ranks = run_on_ranks(_train_rank, cp, argv, threads, timeout=args.timeout,
                             start_method="spawn")  # fmt: skip
        losses = [json.loads(line)["lm loss"] for line in Path(metrics).read_text().splitlines()]
    timed = slice(args.warmup, args.warmup + args.iters)
    worst = {key: [max(values) for values in zip(*(r[key][timed] for r in ranks), strict=True)]
             for key in ranks[0] if key != "ring_waits"}  # fmt: skip
    return {
        **worst,
        "ring_waits_per_iteration": ranks[0]["ring_waits"][args.warmup],
        "losses": [round(x, 4) for x in losses],
    }


def _argv(seq: int, cp: int, iterations: int, metrics_file: str) -> list[str]:
    argv = [
        *llama_flags(),
        "--seq-length", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(iterations), "--eval-interval", "none",
        "--bf16", "--lr", "1e-3", "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
        "--num-workers", "0", "--split", "100,0,0", "--log-interval", "1",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--metrics-file", metrics_file,
    ]  # fmt: skip
    if cp > 1:
        argv += ["--context-parallel-size", str(cp), "--cp-comm-type", "p2p"]
    return argv


# On each rank (a spawned process).


def _train_rank(argv: list[str], threads: int) -> dict[str, list]:
    torch.set_num_threads(threads)
    os.environ["MP_RUN_DIR"] = "/nonexistent"  # no run directory
    from mp_gpt.gpt import datasets_provider, forward_step, model_provider
    from mp_layers.context_parallel import timed_ring_waits
    from mp_train import parse_config, pretrain

    config = parse_config(argv)
    probe = _IterationProbe()

    def step(data_iterator, model):
        probe.iteration_boundary()
        return forward_step(data_iterator, model)

    with timed_ring_waits() as waits, contextlib.redirect_stdout(io.StringIO()):
        probe.waits = waits
        pretrain(config, model_provider=model_provider, datasets_provider=datasets_provider,
                 forward_step_func=step)  # fmt: skip
    return probe.records


class _IterationProbe:
    """Called at the start of every forward step (one per iteration): closes the previous
    iteration's records (seconds, peak memory, ring waits) and opens the next."""

    def __init__(self) -> None:
        self.waits = None
        self.records: dict[str, list] = {
            "iteration_s": [], "peak_rss_mib": [], "peak_growth_mib": [], "ring_wait_s": [],
            "ring_wait_kv_s": [], "ring_wait_grad_s": [], "ring_waits": [],
        }  # fmt: skip
        self._start = None

    def iteration_boundary(self) -> None:
        end = time.perf_counter()
        if self._start is not None:
            peak = status_mib("VmHWM")
            seconds = dict(self.waits.seconds)
            r = self.records
            r["iteration_s"].append(end - self._start)
            r["peak_rss_mib"].append(peak)
            r["peak_growth_mib"].append(peak - self._rss)
            r["ring_wait_kv_s"].append(seconds["kv"] - self._seconds["kv"])
            r["ring_wait_grad_s"].append(seconds["grad"] - self._seconds["grad"])
            r["ring_wait_s"].append(r["ring_wait_kv_s"][-1] + r["ring_wait_grad_s"][-1])
            r["ring_waits"].append(
                {k: self.waits.waits[k] - self._count[k] for k in self.waits.waits}
            )
        # Bookkeeping outside the timed interval.
        self._rss = reset_peak_rss()
        self._seconds = dict(self.waits.seconds)
        self._count = dict(self.waits.waits)
        self._start = time.perf_counter()


if __name__ == "__main__":
    sys.exit(main())
