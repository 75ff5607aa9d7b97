"""When the loop evaluates, saves, collects garbage and stops: Megatron's eval_interval,
save_interval, manual_gc_interval, exit_interval, exit_duration_in_mins and
exit_signal_handler, and the final evaluation and save.

After each iteration the loop asks, in Megatron's order:

1. `after_iteration(train)`: evaluate (every eval_interval, with validation data, not
   after the last iteration, which the final evaluation covers), save (every
   save_interval, when saving; else a non-persistent one every
   non_persistent_save_interval), collect garbage (manual_gc every manual_gc_interval),
   wait for the device (every train_sync_interval);
2. `stop(iteration, saved=...)`, once the evaluation and save are done (they take time,
   and a signal may come meanwhile): why the run stops after this iteration, if it does
   (the first of, in Megatron's order: SIGTERM on any rank, exit_duration_in_mins on
   the slowest rank's clock, exit_interval or the end of a phase of
   phase_transition_iterations), and whether it saves first (when saving and not saved
   already, a non-persistent save counting, as in Megatron);
3. at the end, `at_end(...)`: the final evaluation (with eval_interval, unless the run
   stopped early, having saved), the final save (unless that iteration is saved
   already) and the evaluation on the test split (as the final evaluation's, after the
   save).

`stop` is collective (SIGTERM and the elapsed time are agreed over every rank), so every
rank stops after the same iteration.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_ckpt import CheckpointConfig, read_tracker
from mp_train.configuration.config import TrainingConfig
from mp_train.configuration.run_checks import check_exit_signal
from mp_train.loop.setup import TrainState
from mp_train.loop.signals import DistributedSignalHandler

__all__ = ["Cadence", "Due", "Stop"]


@dataclass(frozen=True)
class Due:
    """What the loop does now."""

    evaluate: bool = False
    save: bool = False
    test: bool = False
    """Evaluate on the test split (at the end only)."""
    save_non_persistent: bool = False
    """A non-persistent checkpoint (non_persistent_save_interval), when no save is due."""
    collect_garbage: bool = False
    synchronize: bool = False
    """Wait for the device (train_sync_interval)."""


@dataclass(frozen=True)
class Stop:
    """The run stops after this iteration, for `reason`; `save`: it saves first."""

    reason: str
    save: bool
    exit_code: int = 0
    """Non-zero: the run ends with this exit code (the rerun engine's), without the final
    evaluation and save."""


class Cadence:
    """`has_valid_data`, `has_test_data`: whether any rank has validation or test data
    (Megatron's do_valid and do_test). `signal_received()` and `minutes_elapsed()` are by
    default a SIGTERM handler (installed by `during_training()`) and the time since
    `started` (a time.time(); by default the cadence's making; the loop gives the job's
    start, process_clock.py), both agreed over every rank; a test may give its own."""

    def __init__(
        self,
        training: TrainingConfig,
        checkpoint: CheckpointConfig,
        has_valid_data: bool,
        *,
        has_test_data: bool = False,
        started: float | None = None,
        signal_received: Callable[[], bool] | None = None,
        minutes_elapsed: Callable[[], float] | None = None,
    ) -> None:
        self.training = training
        self.save_interval = checkpoint.save_interval
        self.non_persistent_interval = checkpoint.non_persistent_save_interval
        self.phase_ends = set(training.phase_transitions)
        self.save_dir = checkpoint.save
        self.saving = self.save_dir is not None
        self.has_valid_data = has_valid_data
        self.has_test_data = has_test_data
        self._handler = None
        if signal_received is None and self.training.exit_signal_handler:
            self._handler = DistributedSignalHandler(check_exit_signal(training.exit_signal))
            signal_received = self._handler.received
        self.signal_received = signal_received
        self.minutes_elapsed = minutes_elapsed or self._slowest_clock
        self._start = time.time() if started is None else started

    def during_training(self) -> contextlib.AbstractContextManager:
        """For the training loop: installs the SIGTERM handler (with
        exit_signal_handler)."""
        return self._handler or contextlib.nullcontext()

    def finished(self, train: TrainState) -> bool:
        """Whether training is over: train_iters iterations or train_samples samples."""
        if self.training.train_iters is not None:
            return train.iteration >= self.training.train_iters
        return train.consumed_train_samples >= self.training.train_samples

    def after_iteration(self, train: TrainState) -> Due:
        """What follows the iteration `train` has just counted."""
        iteration, training = train.iteration, self.training
        save = bool(self.saving and _every(self.save_interval, iteration))
        return Due(
            evaluate=bool(
                training.eval_interval
                and self.has_valid_data
                and iteration % training.eval_interval == 0
                and iteration >= (training.start_eval_at_iter or 0)
                and not self.finished(train)
            ),
            save=save,
            save_non_persistent=bool(
                self.saving and not save and _every(self.non_persistent_interval, iteration)
            ),
            collect_garbage=bool(
                training.manual_gc and _every(training.manual_gc_interval, iteration)
            ),
            synchronize=_every(training.train_sync_interval, iteration),
        )

    def stop(self, iteration: int, saved: bool) -> Stop | None:
        """Whether the run stops after `iteration` (collective), and saves first unless
        `saved` (it saved this iteration already)."""
        reason = self._stop_reason(iteration)
        if reason is None:
            return None
        return Stop(reason, save=self.saving and not saved)

    def _stop_reason(self, iteration: int) -> str | None:
        training = self.training
        if self.signal_received is not None and self.signal_received():
            return f"{self.training.exit_signal} received"
        if self.time_is_up():
            return f"exit_duration_in_mins={training.exit_duration_in_mins}"
        if _every(training.exit_interval, iteration):
            return f"exit_interval={training.exit_interval}"
        if iteration in self.phase_ends:
            return f"iteration {iteration} ends a training phase (phase_transition_iterations)"
        return None

    def time_is_up(self) -> bool:
        """Whether exit_duration_in_mins have passed since `started` on the slowest rank's
        clock (collective when it is set; 0 sets no limit, as in Megatron)."""
        limit = self.training.exit_duration_in_mins
        return bool(limit) and self.minutes_elapsed() > limit

    def _slowest_clock(self) -> float:
        """Minutes since `started` on the rank whose clock says the most (collective)."""
        elapsed = torch.tensor([(time.time() - self._start) / 60.0])
        if dist.get_backend() == "nccl":
            elapsed = elapsed.cuda()
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def at_end(self, iteration: int, stopped: Stop | None, last_saved: int | None) -> Due:
        """The final evaluation, save and test evaluation, after training (or instead of
        it, with skip_train): no save of an iteration saved already, by this run
        (`last_saved`) or in `save` (its tracker)."""
        training = self.training
        evaluate = training.eval_interval is not None and stopped is None
        save = self.saving and not training.skip_train
        if stopped is not None and stopped.exit_code:
            save = False
        if save:
            save = iteration not in (last_saved, read_tracker(self.save_dir))
        return Due(evaluate=evaluate and self.has_valid_data, save=save,
                   test=evaluate and self.has_test_data)  # fmt: skip


def _every(interval: int | None, iteration: int) -> bool:
    return bool(interval) and iteration % interval == 0
