"""Benchmark: the pipeline bubble of 1F1B and interleaved 1F1B beside its theory.

p ranks (2 and 4), forked by mp_state.testing.run_on_ranks over gloo, one
thread each, run mp_pipeline's schedules on m micro-batches (4, 8, 16):
1F1B (get_forward_backward_func(p, None)) and interleaved 1F1B with v = 2
model chunks per rank (get_forward_backward_func(p, 2)).

The stage is synthetic: x + bias (a parameter of [h]) through an autograd
function that sleeps t in its forward and t in its backward. A sleep stands
for a device kernel: it frees the CPU, so four ranks on two cores behave like
four devices, and every (virtual) stage chunk costs exactly t per micro-batch
in each direction. Boundary tensors are [s, b, h] = [8, 1, 16] (sequence,
micro-batch, hidden), fp32; the last stage's loss is output.sum().

Theory, for equal forward and backward times t per chunk (Narayanan et al.,
2021, section 2.2): a rank's useful work is v * m * 2t; the pipeline adds
(p - 1) * 2t of fill and drain, so the idle fraction of a rank is

    1F1B:         (p - 1) / (m + p - 1)
    interleaved:  (p - 1) / (v * m + p - 1)

(v = 1 for 1F1B). The step's ideal time is (v * m + p - 1) * 2t.

Measure. A barrier, then each rank times its schedule call with
time.perf_counter (CLOCK_MONOTONIC: one clock for every process of the
machine) and sums the time spent inside its sleeps (busy). The step lasts
from the earliest start to the latest end over the ranks: the theory's
bubble is counted against the whole pipeline flush, and the ranks finish at
different times (in 1F1B the last stage is done (p - 1) * t before the
first). A rank's idle fraction is 1 - busy / step; the figures are the mean
and the max over the ranks. Each configuration runs once untimed with t = 0
(a warm-up of its code paths and connections), then `--repeats` times,
and the run with the shortest step is kept: it is the least disturbed by
other processes. (Keeping the lowest idle fraction instead would favour
disturbed runs: when the machine stalls every rank during its sleeps, busy
grows with the step and the idle fraction drops.)
Target: the mean within 10% (relative) of the theory.

What the theory leaves out. Every step between two computations (Python,
autograd, a gloo exchange, waking a process) adds idle time that no bubble
explains. Three figures show it:

- excess_ms_per_slot: the step's time beyond the ideal for the measured
  busy time, per slot of the critical path (2 (v m + p - 1) slots);
- empty_step_ms_per_slot: the same schedule's step with t = 0, per slot
  (its own cost; the shortest of EMPTY_REPEATS runs);
- p2p_latency_after_idle: the one-way latency of one [8, 1, 16] exchange
  through mp_pipeline's P2PCommunicator when the receiving rank has waited
  t for it, beside the same after a 1 ms wait (a process woken after a long
  wait takes longer to run).

An excess e per slot raises the idle fraction by about (v m / (v m + p - 1))
* e / t, so the relative error grows like (v m / (p - 1)) * e / t: largest
for long interleaved pipelines on few ranks. Hence the default t = 500 ms:
with e about 1 ms here, the worst configuration (interleaved, p = 2, m = 16)
expects 32 x 1 / 500 = 0.064, within the target; at t = 20 ms it would
expect 1.6, and at 100 ms 0.32 (docs/benchmarks.md has both). A stage of a
large model on a GPU takes tens to hundreds of milliseconds per micro-batch.

    uv run python ci/bench/bench_pipeline.py            # about 7 minutes
    uv run python ci/bench/bench_pipeline.py --t-ms 20  # the overheads show
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from harness import context, emit

import mp_state
from mp_pipeline import P2PCommunicator, PipelineConfig, get_forward_backward_func
from mp_state.testing import run_on_ranks

SEQ, MICRO_BATCH, HIDDEN = 8, 1, 16
TARGET = 0.10
"""Largest |measured - theory| / theory of the mean idle fraction."""
EMPTY_REPEATS = 10
LATENCY_SAMPLES = 30
PIPELINE_SIZES = (2, 4)
MICROBATCHES = (4, 8, 16)
SCHEDULES = {"1f1b": None, "interleaved": 2}
"""Schedule name -> virtual_pipeline_model_parallel_size."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--t-ms", type=float, default=500.0, help="one chunk's forward (and backward) time, ms"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per configuration")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = parser.parse_args()
    ctx = context()
    t = args.t_ms / 1000
    latency = run_on_ranks(_latency_rank, 2, (0.001, t), timeout=args.timeout)[1]
    emit("p2p_latency_after_idle", _latency_figures(latency, t), ctx)
    for p in PIPELINE_SIZES:
        load_before = round(os.getloadavg()[0], 2)
        per_rank = run_on_ranks(_rank, p, p, t, args.repeats, timeout=args.timeout)
        # Other processes on the machine show here (the ranks themselves add little: they sleep).
        load = {"load_1min_before": load_before, "load_1min_after": round(os.getloadavg()[0], 2)}
        for name, m in per_rank[0]:
            timed, empty = (_runs([rank[(name, m)][kind] for rank in per_rank])
                            for kind in ("timed", "empty"))  # fmt: skip
            figures = _figures(name, p, m, t, timed, empty)
            emit(f"pipeline_bubble[{name},p={p},m={m}]", figures | load, ctx)


def _figures(name: str, p: int, m: int, t: float, timed: list[_Run], empty: list[_Run]) -> dict:
    v = SCHEDULES[name] or 1
    best = min(timed, key=lambda run: run.step)
    theory = (p - 1) / (v * m + p - 1)
    error = (best.idle_mean - theory) / theory
    slots = 2 * (v * m + p - 1)
    # The step the measured sleeps would take with nothing but the bubble around them.
    ideal_for_busy = best.busy_mean * slots / (2 * v * m)
    return {
        "schedule": name, "p": p, "v": v, "m": m, "t_ms": round(t * 1000, 3),
        "measured_idle_fraction": round(best.idle_mean, 4),
        "measured_idle_fraction_max": round(best.idle_max, 4),
        "theory": round(theory, 4),
        "relative_error": round(error, 3),
        "relative_error_max": round((best.idle_max - theory) / theory, 3),
        "target": TARGET,
        "meets_target": abs(error) <= TARGET,
        "step_s": round(best.step, 4),
        "ideal_step_s": round(slots * t, 4),
        "excess_ms_per_slot": round((best.step - ideal_for_busy) / slots * 1000, 3),
        "empty_step_ms_per_slot": round(min(run.step for run in empty) / slots * 1000, 3),
        "busy_s_per_rank": [round(b, 4) for b in best.busy],
        "ideal_busy_s": round(2 * v * m * t, 4),
        "idle_fraction_per_rank": [round(i, 4) for i in best.idle],
        "idle_fraction_mean_of_repeats": round(sum(r.idle_mean for r in timed) / len(timed), 4),
        "repeats": len(timed), "threads_per_rank": 1,
        "boundary_shape_sbh": [SEQ, MICRO_BATCH, HIDDEN],
    }  # fmt: skip


def _runs(per_rank: list[list[tuple[float, float, float]]]) -> list[_Run]:
    """Each run's (start, end, busy) on every rank -> one _Run per run."""
    return [_Run.of(list(run)) for run in zip(*per_rank, strict=True)]


@dataclass
class _Run:
    """One timed schedule call on every rank."""

    step: float
    busy: list[float]
    idle: list[float]

    @classmethod
    def of(cls, per_rank: list[tuple[float, float, float]]) -> _Run:
        """From each rank's (start, end, busy)."""
        step = max(end for _, end, _ in per_rank) - min(start for start, _, _ in per_rank)
        busy = [b for _, _, b in per_rank]
        return cls(step, busy, [1 - b / step for b in busy])

    @property
    def busy_mean(self) -> float:
        return sum(self.busy) / len(self.busy)

    @property
    def idle_mean(self) -> float:
        return sum(self.idle) / len(self.idle)

    @property
    def idle_max(self) -> float:
        return max(self.idle)


# The synthetic stage.


class _Clock:
    """Seconds this rank has spent computing (sleeping)."""

    def __init__(self, t: float) -> None:
        self.t = t
        self.busy = 0.0

    def work(self) -> None:
        start = time.perf_counter()
        time.sleep(self.t)
        self.busy += time.perf_counter() - start


class _Compute(torch.autograd.Function):
    """The identity, costing t in forward and t in backward."""

    @staticmethod
    def forward(ctx, x_sbh: torch.Tensor, clock: _Clock) -> torch.Tensor:
        ctx.clock = clock
        clock.work()
        return x_sbh.clone()

    @staticmethod
    def backward(ctx, grad_sbh: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.work()
        return grad_sbh, None


class _Stage(torch.nn.Module):
    """One (virtual) pipeline stage: [s, b, h] -> [s, b, h] in t."""

    def __init__(self, clock: _Clock, first: bool, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(hidden))
        self.clock, self.first = clock, first
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x_sbh: torch.Tensor) -> torch.Tensor:
        h_sbh = x_sbh if self.first else self.input_tensor
        return _Compute.apply(h_sbh + self.bias, self.clock)


def _forward_step(data_iterator, model: _Stage):
    x_sbh = next(data_iterator)

    def loss_func(output_sbh: torch.Tensor):
        loss = output_sbh.sum()
        return loss, {"loss": loss.detach()}

    return model(x_sbh), loss_func


# One rank.


def _rank(p: int, t: float, repeats: int) -> dict[tuple[str, int], dict[str, list[tuple]]]:
    """(start, end, busy) of each timed run, at t ("timed") and at 0 ("empty"), by (schedule, m)."""
    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig(pipeline_model_parallel_size=p))
    r = state.pp.rank
    config = PipelineConfig(seq_length=SEQ, micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN)
    clock = _Clock(t)
    x_sbh = torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))
    results = {}
    for (name, vpp), m in itertools.product(SCHEDULES.items(), MICROBATCHES):
        if vpp is not None and m % p:
            continue
        chunks = [_Stage(clock, first=r == 0 and c == 0) for c in range(vpp or 1)]
        schedule = get_forward_backward_func(p, vpp)

        def step(chunks=chunks, schedule=schedule, vpp=vpp, m=m) -> None:
            iterators = [itertools.repeat(x_sbh) for _ in chunks]
            schedule(
                forward_step_func=_forward_step,
                data_iterator=iterators if vpp else iterators[0],
                model=chunks if vpp else chunks[0],
                num_microbatches=m, config=config, pp_group=state.pp,
            )  # fmt: skip

        results[(name, m)] = {}
        for kind, seconds, count in (("timed", t, repeats), ("empty", 0.0, EMPTY_REPEATS)):
            clock.t = 0.0
            step()  # untimed
            clock.t = seconds
            runs = []
            for _ in range(count):
                dist.barrier(group=state.pp.group)
                clock.busy = 0.0
                start = time.perf_counter()
                step()
                runs.append((start, time.perf_counter(), clock.busy))
            results[(name, m)][kind] = runs
    mp_state.destroy()
    return results


# The latency of one exchange after a wait.


def _latency_figures(seconds_by_wait: dict[float, list[float]], t: float) -> dict:
    short, long = (sorted(seconds_by_wait[wait]) for wait in (0.001, t))
    median = {name: s[len(s) // 2] * 1e6 for name, s in (("short", short), ("long", long))}
    return {
        "wait_ms": round(t * 1000, 3),
        "median_us": round(median["long"], 1),
        "min_us": round(long[0] * 1e6, 1),
        "p90_us": round(long[int(0.9 * len(long))] * 1e6, 1),
        "baseline_wait_ms": 1.0,
        "baseline_median_us": round(median["short"], 1),
        "ratio_to_baseline": round(median["long"] / median["short"], 2),
        "samples": len(long), "boundary_shape_sbh": [SEQ, MICRO_BATCH, HIDDEN],
    }  # fmt: skip


def _latency_rank(waits: tuple[float, ...]) -> dict[float, list[float]]:
    """Rank 0 waits, then sends its clock; rank 1 (blocked receiving) notes the delay."""
    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig(pipeline_model_parallel_size=2))
    # float64: a perf_counter reading must survive the trip to the microsecond.
    comm = P2PCommunicator(state.pp, (SEQ, MICRO_BATCH, HIDDEN), torch.float64)
    delays: dict[float, list[float]] = {}
    for wait in waits:
        delays[wait] = []
        for i in range(LATENCY_SAMPLES + 1):  # the first exchange is not timed
            if state.pp.rank == 0:
                time.sleep(wait)
                message = torch.zeros(SEQ, MICRO_BATCH, HIDDEN, dtype=torch.float64)
                message[0, 0, 0] = time.perf_counter()
                comm.send_forward(message)
            else:
                received = comm.recv_forward()
                if i:
                    delays[wait].append(time.perf_counter() - float(received[0, 0, 0].detach()))
    mp_state.destroy()
    return delays


if __name__ == "__main__":
    main()
