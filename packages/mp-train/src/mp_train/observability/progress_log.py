"""Megatron-LM's progress log (--log-progress): progress.txt in the save directory, one
line per event, in Megatron's format so that its readers parse it:

    2026-12-05 14:20:01\tJob ID: 1234\t# GPUs: 8\tStarting job
    ...\tSaved checkpoint\tIteration: 100\tJob throughput: 412.3 TFLOP/s/GPU\t
       Cumulative throughput: 405.1 TFLOP/s/GPU\tFloating-point operations: 3.20e+18\t
       Tokens (in billions): 0.41
    ...\tSaving async checkpoint\tIteration: 200\t... (then, once written)
    ...\tSaved async checkpoint\tIteration: 200
    ...\tDeleted checkpoint\tIteration: 100

The job ID is $SLURM_JOB_ID (empty elsewhere); "# GPUs" is the world size. Job throughput
counts this job's floating-point operations (the loop's model FLOPs) over its time since
its processes started (set-up included, as Megatron's); cumulative throughput the
operations since the first job of the file that ran at this world size (a restart at
another size starts a new count), from the operations of the last checkpoint committed
before it. Only global rank 0 writes: a synchronous
save's line after the save, an asynchronous one's before its writer starts (so that
the commit's line, which the writer adds, follows it).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

__all__ = ["ProgressLog"]

_FORMAT = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    def __init__(self, save_dir: str | os.PathLike, world_size: int, writes: bool) -> None:
        """writes: whether this rank writes (global rank 0)."""
        self.path = Path(save_dir) / "progress.txt"
        self.world_size = world_size
        self.writes = writes
        self._started = time.time()
        self._flops_at_start = 0.0

    def job_started(self, flops_so_far: float, started: float | None = None) -> None:
        """Once the job's checkpoint (if any) is loaded: its operations so far, and when
        its processes started (a time.time(); by default now)."""
        self._started = time.time() if started is None else started
        self._flops_at_start = flops_so_far
        self._append("Starting job")

    def saved(self, iteration: int, flops_so_far: float, tokens: int, async_save: bool) -> None:
        """A checkpoint saved (or, async, staged) at `iteration`."""
        if not self.writes:
            return
        job = (flops_so_far - self._flops_at_start) / self._tflops_seconds(self._started)
        start, flops_at_start = self._first_job_of_this_size()
        cumulative = (flops_so_far - flops_at_start) / self._tflops_seconds(start)
        kind = "Saving async checkpoint" if async_save else "Saved checkpoint"
        self._append(
            f"{kind}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops_so_far:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )

    def committed(self, iteration: int, deleted: list[int], async_save: bool) -> None:
        """A checkpoint committed, and the older ones keep_last deleted with it."""
        for old in deleted:
            self._append(f"Deleted checkpoint\tIteration: {old}")
        if async_save:
            self._append(f"Saved async checkpoint\tIteration: {iteration}")

    def _tflops_seconds(self, since: float) -> float:
        return max(time.time() - since, 1e-9) * 10**12 * self.world_size

    def _append(self, text: str) -> None:
        if not self.writes:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now().strftime(_FORMAT)
        with open(self.path, "a") as f:
            f.write(f"{now}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                    f"# GPUs: {self.world_size}\t{text}\n")  # fmt: skip

    def _first_job_of_this_size(self) -> tuple[float, float]:
        """(start time, operations done then) of the first job of the latest run of jobs
        at this world size in the file (Megatron's reading of it)."""
        start, flops_at_start, committed, pending = None, None, 0.0, None
        for line in self.path.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) < 4:
                continue
            event = fields[3]
            if event == "Saved checkpoint":
                committed = _value(fields[7])
            elif event == "Saving async checkpoint":
                pending = _value(fields[7])
            elif event == "Saved async checkpoint" and pending is not None:
                committed, pending = pending, None
            if int(_value(fields[2])) != self.world_size:
                start = flops_at_start = None
                continue
            if event == "Starting job" and start is None:
                when = datetime.datetime.strptime(fields[0], _FORMAT)
                start, flops_at_start = when.timestamp(), committed
        if start is None:  # (this job's own line is in the file)
            return self._started, self._flops_at_start
        return start, flops_at_start


def _value(field: str) -> float:
    return float(field.split(": ")[1])
