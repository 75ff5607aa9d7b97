"""Result validation by running an iteration again (Megatron-LM's rerun engine,
rerun_mode; RerunConfig has the flags).

Each micro-batch's loss on the last pipeline stage (the local sum over its tokens, before
any reduction over ranks) goes through the checks in order: nan, inf (both with
check_for_nan_in_loss_and_grad, unless skip_nan_loss_iterations skips such iterations
instead), then a spike (check_for_spiky_loss). The first that fails on a rank is that
rank's failure. With rerun_mode:

- validate_results, from the job's second iteration on: if any rank failed, every rank
  takes back the random states the iteration started with, reads the same micro-batches
  again (ReplayIterator) and runs forward and backward again. Where the failed loss
  comes out otherwise, the fault was transient: exit code 17, no save (resume from the
  last checkpoint). Where it comes out the same and its check is fatal (nan, inf), the
  run saves a checkpoint of the iteration before, marked to rerun this one, and exits
  with code 16: resumed on other hardware, that run computes the iteration once more.
  The same result there means a correct result (the data or the model, not the
  hardware); another means a persistent fault of the first hardware; either ends with
  exit code 17, and a resume on the same hardware with 16 again. A spike (not fatal)
  is logged with its verdict and training goes on. In a job's first iteration nothing is
  validated (there is no checkpoint to come back to); a nan or inf loss there stops the
  run as with reruns disabled (skip_policy.py).
- report_stats: every iteration runs twice; every second iteration rank 0 logs how often
  the two runs' losses agreed and how far they differed.
- disabled: one run per iteration. A nan or inf loss stops the run (skip_policy.py), a
  spike is logged.

With result_rejected_tracker_filename, each rank appends a line per failed check and per
verdict (rerun_records.py). error_injection_rate / error_injection_type make checks fail
on purpose, to test these paths.

Without a save directory the reproducible case cannot be handed to other hardware: the
run exits with code 17 at once. Evaluation is never validated.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import mp_state
from mp_train.configuration.config import TrainingConfig
from mp_train.loop.rerun_records import SpikeDetector, Tracker, relative_difference, summarize

__all__ = [
    "EXIT_RESUME_ELSEWHERE",
    "EXIT_VALIDATION_FAILED",
    "Attempt",
    "Exit",
    "ReplayIterator",
    "RerunMachine",
    "hardware",
]

log = logging.getLogger("mp_train")

EXIT_RESUME_ELSEWHERE = 16
"""Resume the job from its checkpoint on other hardware, to finish the diagnosis."""
EXIT_VALIDATION_FAILED = 17
"""A loss failed its check and the diagnosis is finished (or cannot go further)."""

_REPORT_EVERY = 2
"""report_stats: iterations between two reports."""


def hardware(device: torch.device) -> tuple[str, str]:
    """Where this rank computes: (the node's name, the device)."""
    return os.uname().nodename, str(device)


@dataclass(frozen=True)
class Exit:
    """The run stops before this iteration's optimizer step with `code`; `save`: it saves
    a checkpoint first (the iteration before, marked to rerun this one)."""

    code: int
    save: bool
    reason: str


@dataclass(frozen=True)
class _Failure:
    check: str  # "nan loss", "inf loss" or "spiky loss"
    microbatch: int  # its index in the iteration, from 0
    result: float
    fatal: bool


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
    recorded, in order."""

    def __init__(self, number: int) -> None:
        self.number = number
        self._losses: list[torch.Tensor] = []

    def watch(self, forward_step_func: Callable) -> Callable:
        def step(*args, **kwargs):
            output, loss_func = forward_step_func(*args, **kwargs)

            def recorded(*largs, **lkwargs):
                result = loss_func(*largs, **lkwargs)
                self._losses.append(torch.as_tensor(result[0]).detach().reshape(()))
                return result

            return output, recorded

        return step

    def losses(self) -> list[float]:
        """This rank's micro-batch losses (none off the last pipeline stage)."""
        if not self._losses:
            return []
        return torch.stack(self._losses).float().cpu().tolist()  # one copy to the host


class RerunMachine:
    """The rerun engine of one rank (see the module docstring). Per iteration the loop runs
    each Attempt that `attempts(iteration)` yields, then reads `exit`."""

    def __init__(self, training: TrainingConfig, rank: int, device: torch.device,
                 rng_tracker, can_save: bool) -> None:  # fmt: skip
        self.mode = training.rerun_mode
        self.rank, self.device, self.rng_tracker = rank, device, rng_tracker
        self.can_save = can_save
        nan = training.check_for_nan_in_loss_and_grad and not training.skip_nan_loss_iterations
        self.spikes = SpikeDetector() if training.check_for_spiky_loss else None
        self.checks: list[tuple[str, bool, Callable[[float], bool]]] = []
        if nan:
            self.checks += [("nan loss", True, math.isnan), ("inf loss", True, math.isinf)]
        if self.spikes is not None:
            self.checks.append(("spiky loss", False, self.spikes.is_spike))
        self.injection_rate = training.error_injection_rate
        self.injection_type = training.error_injection_type
        self._draws = random.Random(training.seed)
        self.injected: str | None = None  # the kind of failure injected, until consumed
        self.tracker = Tracker(training.result_rejected_tracker_filename, rank, str(device))
        self.replays: list[ReplayIterator] = []
        self.validated_before = False  # the job's first iteration is not validated
        self.from_checkpoint: dict | None = None  # the saved failure to run again
        self.pending: dict | None = None  # what the exit's checkpoint records
        self.stats: list[float] = []
        self.exit: Exit | None = None
        if self.mode != "disabled" and rank == 0:
            log.info("result validation: rerun_mode=%s", self.mode)

    @property
    def watching(self) -> bool:
        """Whether the losses are looked at, so that the forward step is wrapped."""
        return bool(self.checks) or self.mode == "report_stats"

    def wrap(self, data):
        """The training data iterator (or a list of them, or None) as the loop uses it:
        replayable when an iteration may run twice."""
        if self.mode == "disabled" or data is None:
            return data
        if isinstance(data, list):
            return [self.wrap(d) for d in data]
        replay = ReplayIterator(data)
        self.replays.append(replay)
        return replay

    def attempts(self, iteration: int) -> Iterator[Attempt]:
        """The runs of iteration `iteration` (from 1): one, or two when it is run again
        (collective: every rank runs the same number). Before a second, the random states
        and the micro-batches are those of the first; afterwards `exit` says whether the
        run stops."""
        self.exit, self.iteration = None, iteration
        for replay in self.replays:
            replay.start()
        if self.mode == "disabled":
            first = Attempt(1)
            yield first
            self._check_without_reruns(first.losses())
            return
        if self.from_checkpoint is not None:
            first = Attempt(1)
            yield first
            self._second_verdict(first.losses())
            return
        started = mp_state.get_rng_state(self.rng_tracker)
        first = Attempt(1)
        yield first
        initial = first.losses()
        if self.mode == "report_stats":
            self._rewind(started)
            second = Attempt(2)
            yield second
            self._record_stats(initial, second.losses())
            return
        failure = self._validate(initial) if self.validated_before else None
        self.validated_before = True
        if not _any_rank([failure is not None])[0]:
            return
        if self.rank == 0:
            log.warning("iteration %d: a loss failed its check: running the iteration again "
                        "with the same data and random states", iteration)  # fmt: skip
        self._rewind(started)
        second = Attempt(2)
        yield second
        self._first_verdict(failure, second.losses())
        if self.exit is not None and self.exit.save:
            # The checkpoint holds the random states the iteration starts with, as the
            # run on other hardware must draw what the first run drew.
            mp_state.set_rng_state(started, self.rng_tracker)

    def _rewind(self, started: dict) -> None:
        mp_state.set_rng_state(started, self.rng_tracker)
        for replay in self.replays:
            replay.rewind()

    def _failed(self, value: float) -> tuple[str, bool, bool] | None:
        """The first check `value` fails: (its name, fatal, injected), or None."""
        for name, fatal, test in self.checks:
            if self._inject():
                return name, fatal, True
            if test(value):
                return name, fatal, False
        return None

    def _inject(self) -> bool:
        if self.injection_rate == 0 or self.injected is not None:
            return False
        if (self._draws.randrange(self.injection_rate) + self.rank) % self.injection_rate:
            return False
        self.injected = self.injection_type
        log.warning("rank %d: iteration %d: injecting a failed check (%s)", self.rank,
                    self.iteration, self.injection_type)  # fmt: skip
        return True

    def _validate(self, losses: list[float]) -> _Failure | None:
        for index, value in enumerate(losses):
            failed = self._failed(value)
            if failed is None:
                continue
            name, fatal, injected = failed
            self.tracker.write(self.iteration, "initial_run", value, name)
            log.error("rank %d: iteration %d: micro-batch %d's loss %r failed the %s check%s",
                      self.rank, self.iteration, index + 1, value, name,
                      " (injected)" if injected else "")  # fmt: skip
            return _Failure(name, index, value, fatal)
        return None

    def _check_without_reruns(self, losses: list[float]) -> None:
        """rerun_mode=disabled: failed checks are recorded and spikes logged; a nan or inf
        loss then stops the run in skip_policy.py."""
        for index, value in enumerate(losses):
            for name, fatal, test in self.checks:
                if test(value):
                    self.tracker.write(self.iteration, "rerun_disabled", value, name)
                    if not fatal:
                        log.warning("rank %d: iteration %d: micro-batch %d's loss %r failed "
                                    "the %s check", self.rank, self.iteration, index + 1,
                                    value, name)  # fmt: skip
                    break

    def _differs(self, failure: _Failure, losses: list[float], second_rerun: bool) -> bool:
        """Whether the rerun's loss differs from the failed one (an injected failure
        decides for itself)."""
        injected = self.injected
        if injected is not None:
            if not second_rerun:
                if injected == "transient_error":
                    self.injected = None
                    return True
                return False
            self.injected = None
            return injected == "persistent_error"
        again = losses[failure.microbatch] if failure.microbatch < len(losses) else math.nan
        return relative_difference(failure.result, again) > 0.0

    def _first_verdict(self, failure: _Failure | None, losses: list[float]) -> None:
        transient = reproducible = False
        if failure is not None:
            again = losses[failure.microbatch] if failure.microbatch < len(losses) else None
            where = f"rank {self.rank}: iteration {self.iteration}: the rerun's loss {again!r}"
            if self._differs(failure, losses, second_rerun=False):
                self.tracker.write(self.iteration, "first_rerun_not_reproducible", again,
                                   failure.check)  # fmt: skip
                log.error("%s differs from the first run's %r: a transient fault (%s)", where,
                          failure.result, "fatal" if failure.fatal else "not fatal")  # fmt: skip
                transient = failure.fatal
            else:
                self.tracker.write(self.iteration, "first_rerun_reproducible", again,
                                   failure.check)  # fmt: skip
                then = "; to be run again on other hardware" if failure.fatal else ""
                node, device = hardware(self.device)
                log.error("%s is the first run's: reproducible on this hardware (%s, %s)%s",
                          where, node, device, then)  # fmt: skip
                reproducible = failure.fatal
        mine_reproduced = reproducible
        if not (failure is not None and failure.fatal):
            self.injected = None  # a spike's injection ends with its verdict
        # Ranks may disagree: a reproducible fatal failure is taken elsewhere (as in
        # Megatron-LM), before a transient one ends the run; a fatal one before a spike.
        transient, reproducible = _any_rank([transient, reproducible])
        if reproducible and self.can_save:
            self.pending = {  # this rank's failure, when it reproduced
                "failure": asdict(failure) if mine_reproduced else None,
                "hardware": list(hardware(self.device)),
                "injected": self.injected,
            }
            self.exit = Exit(EXIT_RESUME_ELSEWHERE, save=True, reason=(
                f"a loss of iteration {self.iteration} failed its check and came out the "
                "same when run again: resume from this checkpoint on other hardware, which "
                "runs the iteration once more to tell a correct result from a faulty "
                "device"))  # fmt: skip
        elif reproducible:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"a loss of iteration {self.iteration} failed its check and came out the "
                "same when run again; without a save directory it cannot be run again on "
                "other hardware"))  # fmt: skip
        elif transient:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"a loss of iteration {self.iteration} failed its check and did not come out "
                "the same when run again (a transient fault); resume from the last "
                "checkpoint"))  # fmt: skip
        elif self.rank == 0:
            log.warning("iteration %d: the failed check is not fatal: training goes on",
                        self.iteration)  # fmt: skip

    def _second_verdict(self, losses: list[float]) -> None:
        saved, self.from_checkpoint = self.from_checkpoint, None
        again_elsewhere = False
        if saved["failure"] is not None:
            failure = _Failure(**saved["failure"])
            where = f"rank {self.rank}: iteration {self.iteration}"
            if list(hardware(self.device)) == saved["hardware"]:
                node, device = saved["hardware"]
                log.error("%s: resumed on the hardware that reproduced the failed loss (%s, "
                          "%s): resume again on other hardware", where, node, device)  # fmt: skip
                again_elsewhere = True
            else:
                again = losses[failure.microbatch] if failure.microbatch < len(losses) else None
                if self._differs(failure, losses, second_rerun=True):
                    self.tracker.write(self.iteration, "second_rerun_not_reproducible", again,
                                       failure.check)  # fmt: skip
                    log.error("%s: the loss on other hardware is %r, not %r: the first "
                              "hardware (%s, %s) computed wrongly, a persistent fault", where,
                              again, failure.result, *saved["hardware"])  # fmt: skip
                else:
                    self.tracker.write(self.iteration, "second_rerun_reproducible", again,
                                       failure.check)  # fmt: skip
                    log.error("%s: the loss on other hardware is the same, %r: a correct "
                              "result (the data or the model, not the hardware)", where,
                              again)  # fmt: skip
        if _any_rank([again_elsewhere])[0]:
            self.exit = Exit(EXIT_RESUME_ELSEWHERE, save=False, reason=(
                f"the rerun of iteration {self.iteration} ran on the hardware that "
                "reproduced its failed loss: resume from the same checkpoint on other "
                "hardware"))  # fmt: skip
        else:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"the rerun of iteration {self.iteration} on other hardware finished its "
                "diagnosis (in the log); the checkpoint stays for examination"))  # fmt: skip

    def _record_stats(self, first: list[float], second: list[float]) -> None:
        self.stats += [relative_difference(a, b) for a, b in zip(first, second, strict=True)]
        if self.iteration % _REPORT_EVERY:
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.stats)
        if self.rank == 0:
            merged = [d for stats in everyone for d in stats]
            log.info("determinism after iteration %d (every iteration run twice), the "
                     "micro-batch losses of every rank: %s", self.iteration,
                     summarize(merged))  # fmt: skip

    # Checkpoints (loop/checkpointing.py keys the per-rank part by the rank's position).

    def saved_state(self) -> tuple[dict | None, dict | None]:
        """(what every rank's checkpoint records, this rank's own part), each None when
        there is nothing to keep."""
        common = None
        mine: dict = {}
        if self.pending is not None:
            common = {"iteration": self.iteration, "mode": self.mode}
            mine |= self.pending
        if self.spikes is not None:
            mine["spikes"] = self.spikes.state_dict()
        return common, mine or None

    def saved(self) -> None:
        """The exit's checkpoint is written: nothing pending any more."""
        self.pending = None

    def load_state(self, common: dict | None, mine: dict | None) -> None:
        """Takes back a checkpoint's state (mine: None when the rank's part is missing or
        was saved at another position)."""
        if mine is not None and self.spikes is not None and "spikes" in mine:
            self.spikes.load_state_dict(mine["spikes"])
        if common is None:
            return
        if self.mode == "disabled":
            if self.rank == 0:
                log.warning("the checkpoint was saved to run iteration %d again; "
                            "rerun_mode=disabled: training goes on without it",
                            common["iteration"])  # fmt: skip
            return
        if mine is None or "hardware" not in mine:
            raise ValueError(
                f"the checkpoint was saved to run iteration {common['iteration']} again on "
                "other hardware, rank by rank: load it with the layout it was saved with "
                "(or with --rerun-mode disabled to go on without the rerun)"
            )
        self.from_checkpoint = {k: mine[k] for k in ("failure", "hardware", "injected")}
        self.injected = mine["injected"]
        if self.rank == 0:
            log.warning("the checkpoint was saved to run iteration %d again: running it on "
                        "this hardware", common["iteration"])  # fmt: skip


def _any_rank(flags: list[bool]) -> list[bool]:
    """Each flag: whether it is set on any rank (collective)."""
    values = torch.tensor([float(f) for f in flags])
    if dist.get_backend() == "nccl":
        values = values.cuda()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in values.tolist()]
