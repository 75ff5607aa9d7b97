"""When the job started, for exit_duration_in_mins and the progress log's job throughput:
as Megatron-LM's, the time counts from the process's start (the earliest rank's), so that
setting up (imports, the model, a checkpoint load, the datasets) counts against a
scheduler's limit, and in the throughput, as training does."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

__all__ = ["earliest_start", "process_start_time"]

_IMPORTED = time.time()
_SANE_AGE_S = 30 * 24 * 3600


def process_start_time() -> float:
    """When this process started (a forked one: when it was forked), on time.time()'s
    scale: Linux's /proc (the boot time plus the process's start in clock ticks, within a
    second); elsewhere, or if that says something impossible, when mp_train was
    imported."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime; the fields after `comm` start at 3
        with open("/proc/stat") as stat:
            boot = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED
    now = time.time()
    return started if now - _SANE_AGE_S < started <= now + 1 else _IMPORTED


def earliest_start() -> float:
    """The earliest process start over every rank (collective)."""
    start = torch.tensor([process_start_time()], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        start = start.cuda()
    dist.all_reduce(start, op=dist.ReduceOp.MIN)
    return float(start)
