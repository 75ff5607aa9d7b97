"""The scheduling policy of CPU runs: SCHED_BATCH for every thread of a rank (Linux).

gloo's TCP transport reads the peers' bytes on a loop thread of its own. When a rank's
thread has written its part of a collective, the peer answers within microseconds and
the kernel wakes this rank's loop thread, which, under the default policy (SCHED_OTHER),
may preempt the writer while it still holds the connection's lock. The loop thread then
finds the lock taken, returns to its level-triggered epoll, is told at once that the
bytes are still there, and spins so until the writer runs again. Where the ranks have
fewer cores than busy threads (two ranks and their gloo threads on a laptop's cores) a
small collective costs several times what it should: on a 2-core CPU two forked ranks
all-reducing 4 floats took 1.0-1.2 ms and 0.7 ms of CPU each, 0.5-0.6 ms of it in the
kernel; under SCHED_BATCH, which takes away a woken thread's right to preempt the running
one, 0.23-0.27 ms and 0.2 ms (four ranks: 3.3 ms and 0.63 ms). A run at TP2, with a
few collectives per layer, steps 1.3x to 1.9x faster (ci/bench/bench_cpu_scheduling.py,
docs/benchmarks.md).

`batch_scheduling()`, called on CPU runs once torch.distributed is up (gloo's threads of
the default group exist then), puts every thread of the process under SCHED_BATCH;
threads and processes started afterwards (the rank groups' gloo threads, data-loader
workers) inherit it. A policy other than SCHED_OTHER on the calling thread (set by
`chrt`, a job scheduler or a test harness) is kept as it is; so is everything on
systems without SCHED_BATCH. `--no-cpu-batch-scheduling` turns it off. apps/gpt's
Generator (generation and the server) calls it too on a CPU.
"""

from __future__ import annotations

import os

__all__ = ["batch_scheduling"]

_TASKS = "/proc/self/task"


def batch_scheduling() -> str:
    """Puts this process's threads under SCHED_BATCH (module docstring); returns what was
    done, for the log."""
    if not hasattr(os, "SCHED_BATCH") or not os.path.isdir(_TASKS):
        return "left as it is (no SCHED_BATCH on this system)"
    policy = os.sched_getscheduler(0)
    if policy != os.SCHED_OTHER:
        return f"left as it is ({_policy_name(policy)}, set before the run)"
    batch = 0
    for name in os.listdir(_TASKS):
        try:
            if os.sched_getscheduler(int(name)) == os.SCHED_OTHER:
                os.sched_setscheduler(int(name), os.SCHED_BATCH, os.sched_param(0))
            batch += os.sched_getscheduler(int(name)) == os.SCHED_BATCH
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as error:
            kept = f"; {batch} threads changed before" if batch else ""
            return f"left as it is (SCHED_BATCH refused: {error.strerror}{kept})"
    return (f"SCHED_BATCH for the process's {batch} threads and those it starts (a woken "
            "gloo thread no longer preempts its rank's thread)")  # fmt: skip


def _policy_name(policy: int) -> str:
    for name in ("SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR"):
        if getattr(os, name, None) == policy:
            return name
    return f"policy {policy}"
