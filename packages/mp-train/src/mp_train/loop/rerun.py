"""Result validation by running an iteration again (Megatron-LM's rerun engine,
rerun_mode; RerunConfig has the flags).

Each micro-batch's loss on the last pipeline stage (the local sum over its tokens, before
any reduction over ranks) goes through the checks in order: nan, inf (both with
check_for_nan_in_loss_and_grad, unless skip_nan_loss_iterations skips such iterations
instead), then a spike (check_for_spiky_loss). Under DDP each gradient bucket's norm
before its reduction does too: nan and inf with check_for_nan_in_grad (which then no
longer raises in DDP), large (10 x the first 100) with check_for_large_grads; a rerun's
norm within 0.1% counts as the same. The first check that fails on a rank, in the order
the values came, is that rank's failure (rerun_checks.py). With rerun_mode:

- validate_results, from the job's second iteration on: if any rank failed, every rank
  takes back the random states the iteration started with, reads the same micro-batches
  again (ReplayIterator) and runs forward and backward again. Where the failed value
  comes out otherwise, the fault was transient: exit code 17, no save (resume from the
  last checkpoint). Where it comes out the same and its check is fatal (nan, inf), the
  run saves a checkpoint of the iteration before, marked to rerun this one, and exits
  with code 16: resumed on other hardware, that run computes the iteration once more.
  The same result there means a correct result (the data or the model, not the
  hardware); another means a persistent fault of the first hardware; either ends with
  exit code 17, and a resume on the same hardware with 16 again. A spike (not fatal)
  is logged with its verdict and training goes on. In a job's first iteration nothing is
  validated (there is no checkpoint to come back to); a nan or inf loss or gradient there
  stops the run as with reruns disabled.
- report_stats: every iteration runs twice; every second iteration rank 0 logs how often
  the two runs' losses (and gradient bucket norms, with a gradient check) agreed and how
  far they differed. Nothing is validated: a nan stops the run as with reruns disabled.
- disabled: one run per iteration. A nan or inf loss stops the run (skip_policy.py), as
  does a nan or inf gradient (DDP raises); a spike or large gradients are logged.

With result_rejected_tracker_filename, each rank appends a line per failed check and per
verdict (rerun_records.py). error_injection_rate / error_injection_type make checks fail
on purpose, to test these paths.

Without a save directory the reproducible case cannot be handed to other hardware: the
run exits with code 17 at once. Evaluation is never validated.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import mp_state
from mp_train.configuration.config import TrainingConfig
from mp_train.loop.any_rank import any_rank
from mp_train.loop.rerun_checks import (
    TOLERANCE,
    Attempt,
    Check,
    Event,
    ReplayIterator,
    checks_for,
)
from mp_train.loop.rerun_records import Tracker, relative_difference, summarize

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
    check: str  # "nan loss", "large grads", ... (rerun_checks.Check.name)
    kind: str  # "loss" or "grads"
    where: str  # "micro-batch 2", "chunk 0 bucket 3"
    result: float
    fatal: bool

    def again(self, events: list[Event]) -> float | None:
        """The same value in a rerun's events (None: it did not come)."""
        for event in events:
            if (event.kind, event.where) == (self.kind, self.where):
                return event.value
        return None


class RerunMachine:
    """The rerun engine of one rank (see the module docstring). Per iteration the loop runs
    each Attempt that `attempts(iteration)` yields, then reads `exit`. `nan_grads`,
    `large_grads`: the optimizer's check_for_nan_in_grad and check_for_large_grads."""

    def __init__(self, training: TrainingConfig, rank: int, device: torch.device,
                 rng_tracker, can_save: bool, nan_grads: bool = False,
                 large_grads: bool = False) -> None:  # fmt: skip
        self.mode = training.rerun_mode
        self.rank, self.device, self.rng_tracker = rank, device, rng_tracker
        self.can_save = can_save
        nan = training.check_for_nan_in_loss_and_grad and not training.skip_nan_loss_iterations
        # DDP raises on a nan gradient itself unless this engine validates it.
        self.validating_grads = nan_grads and self.mode == "validate_results"
        self.checks = checks_for(nan, training.check_for_spiky_loss, self.validating_grads,
                                 large_grads)  # fmt: skip
        self.comparing_grads = self.mode == "report_stats" and (nan_grads or large_grads)
        # validate_results with nothing to check runs each iteration once, as disabled does
        # (no random states kept, no micro-batches kept, no flag agreed).
        self.idle = self.mode == "validate_results" and not any(self.checks.values())
        self.injection_rate = training.error_injection_rate
        self.injection_type = training.error_injection_type
        self._draws = random.Random(training.seed)
        self.injected: str | None = None  # the kind of failure injected, until consumed
        self.tracker = Tracker(training.result_rejected_tracker_filename, rank, str(device))
        self.replays: list[ReplayIterator] = []
        self.current: Attempt | None = None  # the run under way, which gradients go to
        self.validated_before = False  # the job's first iteration is not validated
        self.from_checkpoint: dict | None = None  # the saved failure to run again
        self.pending: dict | None = None  # what the exit's checkpoint records
        self.stats: dict[str, list[float]] = {"loss": [], "grads": []}  # since the report
        self.reported: dict[str, list[float]] = {"loss": [], "grads": []}  # rank 0: all
        self.exit: Exit | None = None
        if self.mode != "disabled" and rank == 0:
            log.info("result validation: rerun_mode=%s", self.mode)

    @property
    def watching(self) -> bool:
        """Whether the losses are looked at, so that the forward step is wrapped."""
        return bool(self.checks["loss"]) or self.mode == "report_stats"

    def watch_gradients(self, chunks: list) -> None:
        """Each DDP chunk reports its buckets' gradients before their reduction, when they
        are checked (or compared, with report_stats); under validate_results a nan is then
        this engine's to judge, not DDP's to raise."""
        if not (self.checks["grads"] or self.comparing_grads):
            return
        for number, chunk in enumerate(chunks):
            if not hasattr(chunk, "grad_observer"):
                continue  # FSDP: no buckets (check_for_nan_in_grad checks its shards)
            chunk.grad_observer = lambda bucket, grad, number=number: self._gradient(
                number, bucket, grad)  # fmt: skip
            if self.validating_grads:
                chunk.raise_on_nonfinite = False

    def _gradient(self, chunk: int, bucket: int, grad: torch.Tensor) -> None:
        if self.current is not None:
            self.current.gradient(chunk, bucket, grad)

    def wrap(self, data):
        """The training data iterator (or a list of them, or None) as the loop uses it:
        replayable when an iteration may run twice."""
        if self.mode == "disabled" or self.idle or data is None:
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
        try:
            yield from self._runs(iteration)
        finally:
            self.current = None

    def _run(self, number: int) -> Attempt:
        self.current = Attempt(number)
        return self.current

    def _runs(self, iteration: int) -> Iterator[Attempt]:
        if self.mode == "disabled" or self.idle:
            first = self._run(1)
            yield first
            self._check_without_reruns(first.events())
            return
        if self.from_checkpoint is not None:
            first = self._run(1)
            yield first
            self._second_verdict(first.events())
            return
        started = mp_state.get_rng_state(self.rng_tracker)
        first = self._run(1)
        yield first
        initial = first.events()
        if self.mode == "report_stats":
            self._rewind(started)
            second = self._run(2)
            yield second
            self._record_stats(initial, second.events())
            return
        if not self.validated_before:
            self.validated_before = True
            self._check_without_reruns(initial)
            return
        failure = self._validate(initial)
        if not any_rank([failure is not None])[0]:
            return
        if self.rank == 0:
            log.warning("iteration %d: a check failed: running the iteration again with the "
                        "same data and random states", iteration)  # fmt: skip
        self._rewind(started)
        second = self._run(2)
        yield second
        self._first_verdict(failure, second.events())
        if self.exit is not None and self.exit.save:
            # The checkpoint holds the random states the iteration starts with, as the
            # run on other hardware must draw what the first run drew.
            mp_state.set_rng_state(started, self.rng_tracker)

    def _rewind(self, started: dict) -> None:
        mp_state.set_rng_state(started, self.rng_tracker)
        for replay in self.replays:
            replay.rewind()

    def _inject(self) -> bool:
        if self.injection_rate == 0 or self.injected is not None:
            return False
        if (self._draws.randrange(self.injection_rate) + self.rank) % self.injection_rate:
            return False
        self.injected = self.injection_type
        log.warning("rank %d: iteration %d: injecting a failed check (%s)", self.rank,
                    self.iteration, self.injection_type)  # fmt: skip
        return True

    def _validate(self, events: list[Event]) -> _Failure | None:
        """This rank's first failed check, in the order the values came (with injection)."""
        for event in events:
            for check in self.checks[event.kind]:
                injected = self._inject()
                if not (injected or check.test(event.value)):
                    continue
                self.tracker.write(self.iteration, "initial_run", event.value, check.name)
                log.error("rank %d: iteration %d: %s: %s %r failed the %s check%s", self.rank,
                          self.iteration, event.where, _noun(event.kind), event.value,
                          check.name, " (injected)" if injected else "")  # fmt: skip
                return _Failure(check.name, event.kind, event.where, event.value, check.fatal)
        return None

    def _check_without_reruns(self, events: list[Event]) -> None:
        """Without a rerun (rerun_mode=disabled, or the job's first iteration): failed
        checks are recorded; a nan or inf gradient stops the run here, a nan or inf loss in
        skip_policy.py; a spike or large gradients are logged."""
        for event in events:
            check = _first_failed(self.checks[event.kind], event.value)
            if check is None:
                continue
            self.tracker.write(self.iteration, "rerun_disabled", event.value, check.name)
            what = (
                f"rank {self.rank}: iteration {self.iteration}: {event.where}: "
                f"{_noun(event.kind)} {event.value!r} failed the {check.name} check"
            )
            if check.fatal and event.kind == "grads":
                raise FloatingPointError(f"{what} (before the data-parallel reduction)")
            if not check.fatal:
                log.warning("%s", what)

    def _differs(self, failure: _Failure, again: float | None, second_rerun: bool) -> bool:
        """Whether the rerun's value differs from the failed one beyond the tolerance (an
        injected failure decides for itself)."""
        injected = self.injected
        if injected is not None:
            if not second_rerun:
                if injected == "transient_error":
                    self.injected = None
                    return True
                return False
            self.injected = None
            return injected == "persistent_error"
        if again is None:
            return True
        return relative_difference(failure.result, again) > TOLERANCE[failure.kind]

    def _first_verdict(self, failure: _Failure | None, events: list[Event]) -> None:
        transient = reproducible = False
        if failure is not None:
            again = failure.again(events)
            where = (f"rank {self.rank}: iteration {self.iteration}: {failure.where}: the "
                     f"rerun's {_noun(failure.kind)} {again!r}")  # fmt: skip
            if self._differs(failure, again, second_rerun=False):
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
        transient, reproducible = any_rank([transient, reproducible])
        if reproducible and self.can_save:
            self.pending = {  # this rank's failure, when it reproduced
                "failure": asdict(failure) if mine_reproduced else None,
                "hardware": list(hardware(self.device)),
                "injected": self.injected,
            }
            self.exit = Exit(EXIT_RESUME_ELSEWHERE, save=True, reason=(
                f"a check of iteration {self.iteration} failed and its value came out the "
                "same when run again: resume from this checkpoint on other hardware, which "
                "runs the iteration once more to tell a correct result from a faulty "
                "device"))  # fmt: skip
        elif reproducible:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"a check of iteration {self.iteration} failed and its value came out the "
                "same when run again; without a save directory it cannot be run again on "
                "other hardware"))  # fmt: skip
        elif transient:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"a check of iteration {self.iteration} failed and its value did not come "
                "out the same when run again (a transient fault); resume from the last "
                "checkpoint"))  # fmt: skip
        elif self.rank == 0:
            log.warning("iteration %d: the failed check is not fatal: training goes on",
                        self.iteration)  # fmt: skip

    def _second_verdict(self, events: list[Event]) -> None:
        saved, self.from_checkpoint = self.from_checkpoint, None
        again_elsewhere = False
        if saved["failure"] is not None:
            failure = _Failure(**saved["failure"])
            where = f"rank {self.rank}: iteration {self.iteration}: {failure.where}"
            noun = _noun(failure.kind)
            if list(hardware(self.device)) == saved["hardware"]:
                node, device = saved["hardware"]
                log.error(
                    "%s: resumed on the hardware that reproduced the failed %s (%s, %s): "
                    "resume again on other hardware", where, noun, node, device,
                )  # fmt: skip
                again_elsewhere = True
            else:
                again = failure.again(events)
                if self._differs(failure, again, second_rerun=True):
                    self.tracker.write(self.iteration, "second_rerun_not_reproducible", again,
                                       failure.check)  # fmt: skip
                    node, device = saved["hardware"]
                    log.error("%s: the %s on other hardware is %r, not %r: the first "
                              "hardware (%s, %s) computed wrongly, a persistent fault", where,
                              noun, again, failure.result, node, device)  # fmt: skip
                else:
                    self.tracker.write(self.iteration, "second_rerun_reproducible", again,
                                       failure.check)  # fmt: skip
                    log.error("%s: the %s on other hardware is the same, %r: a correct "
                              "result (the data or the model, not the hardware)", where,
                              noun, again)  # fmt: skip
        if any_rank([again_elsewhere])[0]:
            self.exit = Exit(EXIT_RESUME_ELSEWHERE, save=False, reason=(
                f"the rerun of iteration {self.iteration} ran on the hardware that "
                "reproduced its failed check: resume from the same checkpoint on other "
                "hardware"))  # fmt: skip
        else:
            self.exit = Exit(EXIT_VALIDATION_FAILED, save=False, reason=(
                f"the rerun of iteration {self.iteration} on other hardware finished its "
                "diagnosis (in the log); the checkpoint stays for examination"))  # fmt: skip

    def _record_stats(self, first: list[Event], second: list[Event]) -> None:
        for a, b in zip(first, second, strict=True):
            self.stats[a.kind].append(relative_difference(a.value, b.value))
        if self.iteration % _REPORT_EVERY:
            return
        # Each rank hands rank 0 the differences since the last report; rank 0 keeps them all.
        everyone: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(self.stats, everyone, dst=0)
        self.stats = {"loss": [], "grads": []}
        if everyone is None:
            return
        for kind in ("loss", "grads"):
            self.reported[kind] += [d for stats in everyone for d in stats[kind]]
            if self.reported[kind]:
                log.info("determinism after iteration %d (every iteration run twice), "
                         "the %s of every rank: %s", self.iteration, _PLURAL[kind],
                         summarize(self.reported[kind]))  # fmt: skip

    # Checkpoints (loop/checkpointing.py keys the per-rank part by the rank's position).

    def saved_state(self) -> tuple[dict | None, dict | None]:
        """(what every rank's checkpoint records, this rank's own part), each None when
        there is nothing to keep."""
        common = None
        mine: dict = {}
        if self.pending is not None:
            common = {"iteration": self.iteration, "mode": self.mode}
            mine |= self.pending
        spikes = _spike_detectors(self.checks)
        if spikes:
            mine["spikes"] = {name: d.state_dict() for name, d in spikes.items()}
        return common, mine or None

    def saved(self) -> None:
        """The exit's checkpoint is written: nothing pending any more."""
        self.pending = None

    def load_state(self, common: dict | None, mine: dict | None,
                   rng_restored: bool = True) -> None:  # fmt: skip
        """Takes back a checkpoint's state (mine: None when the rank's part is missing or
        was saved at another position; rng_restored: whether the run took back the saved
        random states)."""
        if mine is not None:
            for name, detector in _spike_detectors(self.checks).items():
                if name in mine.get("spikes", {}):
                    detector.load_state_dict(mine["spikes"][name])
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
            if not rng_restored:
                log.warning(
                    "the saved random states were not taken back (no_load_rng, or saved "
                    "with no_save_rng): with dropout the rerun draws other numbers than the "
                    "first run, and may differ for that alone"
                )


_PLURAL = {"loss": "micro-batch losses", "grads": "gradient buckets' norms"}


def _noun(kind: str) -> str:
    return {"loss": "loss", "grads": "gradient norm"}[kind]


def _first_failed(checks: list[Check], value: float) -> Check | None:
    return next((check for check in checks if check.test(value)), None)


def _spike_detectors(checks: dict[str, list[Check]]) -> dict:
    """The spike detectors behind the checks, by check name (their state is saved)."""
    return {check.name: check.detector for kind in checks.values() for check in kind
            if check.detector is not None}  # fmt: skip
