"""Megatron-LM's --profile with torch.profiler: iterations profile_step_start to
profile_step_end - 1 on the profile_ranks (empty: every rank).

    profiler = StepProfiler(config.logging, rank, device)
    per iteration n (1-based):  profiler.iteration_started(n) ... profiler.iteration_finished(n)

As Megatron's schedule, the iteration before the first profiled one warms the
profiler up (when this process runs it); a resumed run starting inside the
window profiles from its first iteration. Each profiled iteration is a
`iteration <n>` range in the trace. When the last one ends the trace goes to
tensorboard_dir through torch.profiler.tensorboard_trace_handler, as
`rank<N>.<time>.pt.trace.json` (TensorBoard's profiler plugin, or
chrome://tracing / Perfetto, read it). Activities: the CPU, and CUDA on GPUs.
Megatron's options: pytorch_profiler_collect_shapes (the operators' input shapes),
pytorch_profiler_collect_callstack (their Python stacks) and
pytorch_profiler_collect_chakra (an execution trace of the same iterations, as
chakra/rank<N>.json under tensorboard_dir).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mp_train.configuration.config import LoggingConfig

__all__ = ["StepProfiler"]


class StepProfiler:
    def __init__(self, config: LoggingConfig, rank: int, device: torch.device) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.enabled = config.profile and (not config.profile_ranks or rank in config.profile_ranks)
        self.first = max(config.profile_step_start, 1)
        self.end = config.profile_step_end
        self._profiler: torch.profiler.profile | None = None
        self._observer: torch.profiler.ExecutionTraceObserver | None = None
        self._range: torch.profiler.record_function | None = None

    def iteration_started(self, iteration: int) -> None:
        """Before iteration `iteration` (1-based): starts the profiler at the warm-up
        iteration (or the first profiled one) and opens the iteration's range."""
        if not self.enabled:
            return
        if self._profiler is None and self.first - 1 <= iteration < self.end:
            warmup = 1 if iteration < self.first else 0
            self._profiler = self._start(warmup, self.end - iteration - warmup)
        if self._profiler is not None and iteration >= self.first:
            self._range = torch.profiler.record_function(f"iteration {iteration}")
            self._range.__enter__()

    def iteration_finished(self, iteration: int) -> None:
        """After iteration `iteration`: closes its range; after the last profiled one
        writes the trace and stops."""
        if self._profiler is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._profiler.step()
        if iteration >= self.end - 1:
            self._stop()
            self.enabled = False

    def close(self) -> None:
        """Stops a profiler the run left running (it stopped inside the window): the
        trace of the iterations profiled so far is written."""
        if self._profiler is not None:
            if self._range is not None:
                self._range.__exit__(None, None, None)
            self._stop()

    def _stop(self) -> None:
        """Writes the trace (and ends the execution trace's file) and stops."""
        self._profiler.stop()
        self._profiler = None
        if self._observer is not None:
            self._observer.unregister_callback()
            self._observer = None

    def _start(self, warmup: int, active: int) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(
            self.config.tensorboard_dir, worker_name=f"rank{self.rank}"
        )
        observer = None
        if self.config.pytorch_profiler_collect_chakra:
            folder = Path(self.config.tensorboard_dir) / "chakra"
            folder.mkdir(parents=True, exist_ok=True)
            observer = torch.profiler.ExecutionTraceObserver().register_callback(
                str(folder / f"rank{self.rank}.json")
            )
            self._observer = observer
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=handler,
            record_shapes=self.config.pytorch_profiler_collect_shapes,
            with_stack=self.config.pytorch_profiler_collect_callstack,
            execution_trace_observer=observer,
        )
        profiler.start()
        return profiler
