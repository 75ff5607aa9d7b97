"""What the rerun engine (rerun.py) looks at in one run of an iteration: the values it
records (each micro-batch's loss; with DDP, each gradient bucket's norm before its
reduction), the checks each kind of value goes through, and the replayable data
iterator a second run reads the same micro-batches from."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mp_train.loop.rerun_records import SpikeDetector

__all__ = ["Attempt", "Check", "Event", "ReplayIterator", "checks_for"]

TOLERANCE = {"loss": 0.0, "grads": 1e-3}
"""How far a rerun's value may differ and still count as the same (Megatron-LM's: the
forward is deterministic; a gradient norm may move by 0.1% under a non-deterministic
backward)."""


@dataclass(frozen=True)
class Event:
    """A value the run produced: `kind` "loss" or "grads", `where` names it within the
    iteration ("micro-batch 2", "chunk 0 bucket 3")."""

    kind: str
    where: str
    value: float


@dataclass(frozen=True)
class Check:
    name: str  # "nan loss", "inf loss", "spiky loss", "nan grads", "inf grads", "large grads"
    fatal: bool
    test: Callable[[float], bool]
    detector: SpikeDetector | None = None  # a spike check's (its state is checkpointed)


def checks_for(nan_loss: bool, spiky_loss: bool, nan_grads: bool,
               large_grads: bool) -> dict[str, list[Check]]:  # fmt: skip
    """The checks of each kind of value, in the order they run."""
    checks: dict[str, list[Check]] = {"loss": [], "grads": []}
    kinds = (("loss", nan_loss, spiky_loss, "spiky loss"),
             ("grads", nan_grads, large_grads, "large grads"))  # fmt: skip
    for kind, nan, spikes, spike_name in kinds:
        if nan:
            checks[kind] += [Check(f"nan {kind}", True, math.isnan),
                             Check(f"inf {kind}", True, math.isinf)]  # fmt: skip
        if spikes:
            detector = SpikeDetector()
            checks[kind].append(Check(spike_name, False, detector.is_spike, detector))
    return checks


class ReplayIterator:
    """An iterator over a loader that keeps the current iteration's items, to hand them out
    again after rewind(). A dict or list item is handed out as a shallow copy, so that a
    forward step changing a batch's dict leaves the kept one alone."""

    def __init__(self, source: Iterator) -> None:
        self.source = source
        self.kept: list = []
        self.replaying, self.position = False, 0

    def __iter__(self) -> ReplayIterator:
        return self

    def __next__(self):
        if self.replaying:
            if self.position == len(self.kept):
                raise RuntimeError(
                    "the rerun of an iteration asked for more micro-batches than its first run"
                )
            item = self.kept[self.position]
            self.position += 1
            return _shallow(item)
        item = next(self.source)
        self.kept.append(item)
        return _shallow(item)

    def start(self) -> None:
        """A new iteration: forget the last one's items."""
        self.kept, self.replaying, self.position = [], False, 0

    def rewind(self) -> None:
        """Hand out this iteration's items again, from the first."""
        self.replaying, self.position = True, 0


def _shallow(item):
    return copy.copy(item) if isinstance(item, dict | list) else item


class Attempt:
    """One run of an iteration's forward and backward; `number` 1 is the first. `watch`
    wraps the forward step function so that the losses of this rank's micro-batches are
    recorded, in order; `gradient` records a gradient bucket's norm."""

    def __init__(self, number: int) -> None:
        self.number = number
        self._recorded: list[tuple[str, str, torch.Tensor]] = []
        self._microbatches = 0

    def watch(self, forward_step_func: Callable) -> Callable:
        def step(*args, **kwargs):
            output, loss_func = forward_step_func(*args, **kwargs)

            def recorded(*largs, **lkwargs):
                result = loss_func(*largs, **lkwargs)
                self._microbatches += 1
                value = torch.as_tensor(result[0]).detach().reshape(())
                self._recorded.append(("loss", f"micro-batch {self._microbatches}", value))
                return result

            return output, recorded

        return step

    def gradient(self, chunk: int, bucket: int, grad: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(grad.detach().float())
        self._recorded.append(("grads", f"chunk {chunk} bucket {bucket}", norm))

    def events(self) -> list[Event]:
        """What this rank recorded, in order (one copy to the host)."""
        if not self._recorded:
            return []
        values = torch.stack([v.float() for _, _, v in self._recorded]).cpu().tolist()
        pairs = zip(self._recorded, values, strict=True)
        return [Event(kind, where, value) for (kind, where, _), value in pairs]
