"""Named timers with log levels, reported as min/max across ranks.

    timers = Timers(log_level=1, log_option="minmax")
    timers("forward-backward", log_level=1).start(barrier=True)
    ...
    timers("forward-backward").stop()
    line = timers.report(["forward-backward"], normalizer=log_interval)   # collective
    times = timers.gather(["forward-backward"])   # {name: ms on each rank}, collective

A timer above the configured level is a no-op. `barrier=True` puts a
barrier before starting (comparable times across ranks). Reporting gathers
every rank's elapsed milliseconds and gives the max (and min), Megatron's
"minmax" option, or every rank's ("all").
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["Timers"]


class _Timer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.elapsed_s = 0.0
        self._started: float | None = None

    def start(self, barrier: bool = False) -> _Timer:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if barrier and dist.is_initialized():
            dist.barrier()
        _sync()
        self._started = time.perf_counter()
        return self

    def stop(self, barrier: bool = False) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        if barrier and dist.is_initialized():
            dist.barrier()
        _sync()
        self.elapsed_s += time.perf_counter() - self._started
        self._started = None

    def take(self) -> float:
        """Elapsed seconds so far; resets."""
        elapsed, self.elapsed_s = self.elapsed_s, 0.0
        return elapsed


class _NoTimer:
    def start(self, barrier: bool = False) -> _NoTimer:
        return self

    def stop(self, barrier: bool = False) -> None:
        pass


class Timers:
    def __init__(self, log_level: int = 0, log_option: str = "minmax") -> None:
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(f"timing_log_option={log_option!r} must be max, minmax or all")
        self.log_level = log_level
        self.log_option = log_option
        self._timers: dict[str, _Timer] = {}
        self._none = _NoTimer()

    def __call__(self, name: str, log_level: int = 0) -> _Timer | _NoTimer:
        if log_level > self.log_level:
            return self._none
        return self._timers.setdefault(name, _Timer(name))

    def elapsed_ms(self, names: list[str], normalizer: float = 1.0) -> dict[str, float]:
        """This rank's milliseconds per timer (divided by normalizer); resets them."""
        return {n: self._timers[n].take() * 1000.0 / normalizer for n in names if n in self._timers}

    def gather(self, names: list[str], normalizer: float = 1.0) -> dict[str, list[float]]:
        """Each timer's milliseconds on every rank, in rank order (divided by normalizer);
        resets them. Collective when distributed."""
        mine = self.elapsed_ms(names, normalizer)
        names = [n for n in names if n in mine]
        values = torch.tensor([mine[n] for n in names], dtype=torch.float64)
        if dist.is_initialized() and dist.get_backend() == "nccl":
            values = values.cuda()
        if dist.is_initialized() and names:
            gathered = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, values)
            table = torch.stack(gathered).cpu()
        else:
            table = values.cpu().unsqueeze(0)
        return {name: table[:, i].tolist() for i, name in enumerate(names)}

    def report(self, names: list[str], normalizer: float = 1.0) -> str:
        """One line with each timer across ranks (collective when distributed)."""
        return self.format(self.gather(names, normalizer))

    def format(self, gathered: dict[str, list[float]]) -> str:
        """The line of `report` for what `gather` returned."""
        parts = []
        for name, column in gathered.items():
            if self.log_option == "max":
                parts.append(f"{name}: {max(column):.1f}")
            elif self.log_option == "minmax":
                parts.append(f"{name}: ({min(column):.1f}, {max(column):.1f})")
            else:
                parts.append(f"{name}: [{', '.join(f'{v:.1f}' for v in column)}]")
        return "time (ms) | " + " | ".join(parts)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
