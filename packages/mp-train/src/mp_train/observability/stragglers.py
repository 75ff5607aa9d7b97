"""Megatron-LM's --log-straggler: which ranks are slow, every log interval.

    step = timed_forward_step(forward_step_func, timers)   # every rank, before the loop
    ...
    times = timers.gather([..., STRAGGLER_TIMER], normalizer=iterations)   # collective
    print(straggler_line(times[STRAGGLER_TIMER], count=1))

What is timed is each rank's forward steps (fetching the batch and the model's
forward, for every micro-batch), not the whole iteration: the collectives of the
loss and of the gradients make every rank wait for the slowest, so a rank's wall
time per iteration is the same on all ranks and names no one. As Megatron's
detector, the forward's own collectives (tensor, context, expert parallel) still
make the ranks of one such group wait for each other: there the slow group stands
out, not its slow rank. On GPUs the timer synchronizes the device around each
forward step, so the figure is the device's time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from mp_train.observability.timers import Timers

__all__ = ["STRAGGLER_TIMER", "straggler_line", "timed_forward_step"]

STRAGGLER_TIMER = "forward-step"


def timed_forward_step(forward_step_func: Callable, timers: Timers) -> Callable:
    """forward_step_func, timed into timers' STRAGGLER_TIMER (created now, so every rank
    has it when the timers are gathered)."""
    timer = timers(STRAGGLER_TIMER, log_level=0)

    def forward_step(*args, **kwargs):
        timer.start()
        try:
            return forward_step_func(*args, **kwargs)
        finally:
            timer.stop()

    return forward_step


def straggler_line(ms_by_rank: list[float], count: int = 1) -> str:
    """The log line of each rank's forward-step milliseconds per iteration: min, median,
    max across ranks, and the `count` slowest and fastest ranks with their times."""
    order = sorted(range(len(ms_by_rank)), key=lambda rank: (ms_by_rank[rank], rank))
    count = min(count, len(order))

    def named(ranks: list[int]) -> str:
        return ", ".join(f"rank {rank} {ms_by_rank[rank]:.1f}" for rank in ranks)

    return (
        f"stragglers | forward-step ms per iteration across {len(order)} ranks: "
        f"min {ms_by_rank[order[0]]:.1f} | median {statistics.median(ms_by_rank):.1f} | "
        f"max {ms_by_rank[order[-1]]:.1f} | slowest {named(order[::-1][:count])} | "
        f"fastest {named(order[:count])}"
    )
