"""Evaluation: forward-only global batches of the validation split (every eval_interval
and at the end) or of the test split (once, at the end), their reports averaged and
logged; with full validation each set read whole (full_validation.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mp_train.loop.forward_backward import empty_unused_memory, schedule_of
from mp_train.loop.full_validation import FullValidation
from mp_train.loop.hang_watchdog import HangWatchdog
from mp_train.loop.reports import reduce_reports
from mp_train.loop.setup import Run

__all__ = ["evaluate"]


def evaluate(run: Run, forward_step_func, valid_iter, metrics, final: bool = False,
             watchdog: HangWatchdog | None = None, test: bool = False,
             time_is_up: Callable[[], bool] | None = None) -> dict | None:  # fmt: skip
    """eval_iters forward-only global batches (with full validation, every validation set
    whole, each logged on its own: full_validation.py); logs and returns the averaged
    reports (the last set's). Each batch is progress for the hang watchdog, when given.
    test: valid_iter reads the test split (at the end, logged as such; the validation's
    consumed samples stay). time_is_up() (collective), asked after each batch: when it
    says so the evaluation stops there, unreported (None), as Megatron's does when
    exit_duration_in_mins passes, so that the run can still save before its time ends."""
    if not isinstance(valid_iter, FullValidation):
        results = _evaluate(run, forward_step_func, valid_iter, run.config.training.eval_iters,
                            watchdog, counted=not test, time_is_up=time_is_up)  # fmt: skip
        return _report(run, metrics, results, final=final, test=test)
    for index, (suffix, _) in enumerate(valid_iter.sets):  # each set whole, from its start
        iterators = valid_iter.iterators(run, index)
        try:
            iterator = iterators if len(iterators) > 1 else iterators[0]
            results = _evaluate(run, forward_step_func, iterator, valid_iter.batches[index],
                                watchdog, global_batch=valid_iter.global_batch,
                                time_is_up=time_is_up)  # fmt: skip
        finally:
            for opened in iterators:
                if opened is not None:
                    opened.close()
        if _report(run, metrics, results, final=final, suffix=suffix, test=test) is None:
            return None  # the later sets are left out too
    return results


def _report(run: Run, metrics, results: dict | None, **labels) -> dict | None:
    """Logs an evaluation's results, or that the time limit cut it short (None)."""
    if results is None:
        metrics.print(f"evaluation stopped at iteration {run.train.iteration}: "
                      f"exit_duration_in_mins={run.config.training.exit_duration_in_mins} "
                      "has passed")  # fmt: skip
    else:
        metrics.evaluation(results, **labels)
    return results


def _evaluate(run: Run, forward_step_func, valid_iter, iterations: int,
              watchdog: HangWatchdog | None, global_batch: int | None = None,
              counted: bool = True, time_is_up: Callable[[], bool] | None = None
              ) -> dict | None:  # fmt: skip
    """`iterations` forward-only global batches of valid_iter; the averaged reports (None
    when time_is_up() says so after a batch). They advance consumed_valid_samples when
    `counted`, unless `global_batch` is given (full validation's, which restarts each
    time; the batch it padded its sets to)."""
    fixed = global_batch
    counted = counted and fixed is None
    cut = False
    for chunk in run.model:
        chunk.eval()
    schedule = schedule_of(run)
    training = run.config.training
    mbs = training.eval_micro_batch_size or training.micro_batch_size
    pipeline = dataclasses.replace(run.pipeline, micro_batch_size=mbs)
    gathered: list = []
    with torch.no_grad():
        for _ in range(iterations):
            global_batch = fixed or training.eval_global_batch_size or run.calculator.global_batch(
                run.train.consumed_train_samples)  # fmt: skip
            gathered += schedule(
                forward_step_func=forward_step_func, data_iterator=valid_iter, model=run.model,
                num_microbatches=global_batch // (mbs * run.data_parallel_size),
                config=pipeline, pp_group=run.state.pp, forward_only=True,
            )  # fmt: skip
            if counted:
                run.train.consumed_valid_samples += global_batch
            empty_unused_memory(run, level=1)
            if watchdog is not None:
                watchdog.step()
            if time_is_up is not None and time_is_up():
                cut = True
                break
    for chunk in run.model:
        chunk.train()
    return None if cut else reduce_reports(gathered)
