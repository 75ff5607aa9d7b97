"""pretrain(): Megatron's training loop over the mp packages.

    pretrain(config, model_provider=..., datasets_provider=..., forward_step_func=...)

1. setup_run: torch.distributed, rank groups, seeds, tokenizer, model chunks
   (DDP), optimizer, scheduler (setup.py);
2. a checkpoint under `load`, resharded if the layout changed (checkpointing.py);
3. datasets from datasets_provider(run, [train, valid, test] sample counts)
   and loaders that start after the consumed samples (mp-data);
4. iterations until train_iters / train_samples, each a step (`_Step`: the pipeline
   schedule's forward and backward (mp-pipeline), run again when the rerun engine
   (rerun.py) asks, the MoE parts around it (moe_step.py), the NaN/skip policy
   (skip_policy.py), the optimizer step, the scheduler by the global batch; an iteration
   of iterations_to_skip only drops its batch), then its log (observability: every
   log_interval, TensorBoard every tensorboard_log_interval, the profiler's window) and
   what the cadence (cadence.py)
   says is due: evaluation every eval_interval, saves every save_interval, an exit at
   exit_interval, exit_duration_in_mins or SIGTERM (every rank agrees, saves and
   returns);
5. a final evaluation and save, the test split's evaluation, and, with export_hf_dir,
   the model written as a Hugging Face directory (hf_start.py).

From the first iteration to the final save, each finished iteration is a heartbeat of
the hang watchdog (hang_timeout_minutes; hang_watchdog.py).

forward_step_func(data_iterator, model) -> (output, loss_func), with
loss_func(output) -> (loss, report) as in Megatron; a report's values are
scalars (averaged) or [sum, count] pairs (summed over micro-batches, then
divided): the loss function averages them over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import Checkpointer
from mp_train.configuration.config import RunConfig, hang_timeout_minutes
from mp_train.loop.cadence import Cadence, Stop
from mp_train.loop.checkpointing import (
    export_run_hf,
    load_run_checkpoint,
    prepare_run_checkpointer,
    save_run_checkpoint,
)
from mp_train.loop.data_iterators import data_iterators
from mp_train.loop.dsa_step import discard_indexer_losses, indexer_losses
from mp_train.loop.evaluation import evaluate
from mp_train.loop.forward_backward import empty_unused_memory, schedule_of
from mp_train.loop.hang_watchdog import HangWatchdog
from mp_train.loop.moe_step import MoEStep
from mp_train.loop.mtp_step import discard_mtp_losses, mtp_losses
from mp_train.loop.process_clock import earliest_start
from mp_train.loop.qk_clip_step import clip_after_step
from mp_train.loop.replica_check import check_weight_replicas
from mp_train.loop.reports import counted_nothing, reduce_reports
from mp_train.loop.rerun import RerunMachine
from mp_train.loop.rerun_records import iterations_to_skip
from mp_train.loop.setup import SETUP_TIMERS, Initialized, ModelProvider, Run, setup_run
from mp_train.loop.signals import shutdown_on_signals
from mp_train.loop.skip_policy import SkipPolicy
from mp_train.loop.upcycling import upcycle_and_save
from mp_train.observability.metrics import MetricsLogger
from mp_train.observability.profiling import StepProfiler
from mp_train.observability.progress_log import ProgressLog
from mp_train.observability.stragglers import timed_forward_step

__all__ = ["pretrain"]

log = logging.getLogger("mp_train")

DatasetsProvider = Callable[[Run, list[int]], tuple[Any, Any, Any]]


def pretrain(
    config: RunConfig,
    *,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step_func: Callable,
    initialized: Initialized | None = None,
) -> Run:
    """Trains (see the module docstring); returns the run at its end (collective).
    `initialized`: what initialize() set up, when the caller initialized first. Under
    exit_signal_handler_for_training SIGINT and SIGTERM raise TrainingShutdown."""
    with shutdown_on_signals(config.training.exit_signal_handler_for_training):
        return _pretrain(config, model_provider, datasets_provider, forward_step_func,
                         initialized)  # fmt: skip


def _pretrain(config: RunConfig, model_provider, datasets_provider, forward_step_func,
              initialized) -> Run:  # fmt: skip
    run = setup_run(config, model_provider, initialized)
    run.rerun = RerunMachine(config.training, dist.get_rank(), run.device, run.rng_tracker,
                             can_save=config.checkpoint.save is not None,
                             nan_grads=config.optimizer.check_for_nan_in_grad,
                             large_grads=config.optimizer.check_for_large_grads)  # fmt: skip
    run.rerun.watch_gradients(run.model)
    metrics = MetricsLogger(run)
    metrics.print_start()
    started = earliest_start()  # the job's: its earliest rank's process start
    checkpointer = _checkpointer(run, metrics, started)
    non_persistent = _non_persistent(run, checkpointer)
    opened: list = []  # the loaders' iterators, closed however the run ends
    try:
        # Starting a DataLoader draws its base seed from torch's default generator: undone,
        # so that the first iteration draws what the checkpoint (or the seeding) left there.
        run.timers(SETUP_TIMERS[1]).start(barrier=True)
        with mp_state.rng_state_kept(run.rng_tracker):
            train_iter, valid_iter, open_test = data_iterators(run, datasets_provider, opened)
        run.timers(SETUP_TIMERS[1]).stop()
        metrics.print(run.timers.report(list(SETUP_TIMERS)))  # collective
        cadence = Cadence(config.training, config.checkpoint, run.has_valid_data,
                          has_test_data=run.has_test_data, started=started)  # fmt: skip
        watching = HangWatchdog.for_run(hang_timeout_minutes(config), dist.get_rank(),
                                        dist.get_world_size())  # fmt: skip
        with watching as watchdog:
            stopped = None
            if not config.training.skip_train:
                stopped = _train(run, forward_step_func, train_iter, valid_iter,
                                 (checkpointer, non_persistent), cadence, metrics,
                                 watchdog)  # fmt: skip
            last_saved = None if checkpointer is None else checkpointer.last_saved
            # A run stopping on a non-persistent save stops saved (Megatron's rule).
            np_saved = None if non_persistent is None else non_persistent.last_saved
            if stopped is not None and np_saved == run.train.iteration:
                last_saved = run.train.iteration
            end = cadence.at_end(run.train.iteration, stopped, last_saved)
            if end.evaluate:
                evaluate(run, forward_step_func, valid_iter, metrics, final=True,
                         watchdog=watchdog, time_is_up=cadence.time_is_up)  # fmt: skip
            if end.save:
                with watchdog.paused():
                    save_run_checkpoint(run, checkpointer)
            if end.test:  # its loaders start now, their seeds drawn off the run's generator
                with mp_state.rng_state_kept(run.rng_tracker):
                    test_iter = open_test()
                evaluate(run, forward_step_func, test_iter, metrics, final=True,
                         watchdog=watchdog, test=True, time_is_up=cadence.time_is_up)  # fmt: skip
            if config.checkpoint.export_hf_dir is not None:
                _export(run, stopped, metrics, watchdog)
    finally:
        # Their worker processes stop here, not whenever the collector reaches an
        # iterator that an error's traceback kept alive.
        for iterator in opened:
            iterator.close()
        if checkpointer is not None:
            checkpointer.finalize()
        metrics.close()
    return run


def _export(run: Run, stopped: Stop | None, metrics: MetricsLogger, watchdog) -> None:
    """The Hugging Face export at the end of training; none when the run stopped before
    its end (an exit condition or a signal: it is to be resumed, not exported)."""
    if stopped is not None:
        metrics.print(f"no Hugging Face export: the run stopped before its end ({stopped.reason})")
        return
    with watchdog.paused():
        export_run_hf(run)


def _checkpointer(run: Run, metrics: MetricsLogger, started: float) -> Checkpointer | None:
    """The run's checkpoint under `load` restored; the checkpointer that saves to `save`.
    `started`: the job's start, for the progress log's job throughput."""
    config = run.config
    checkpointer = None
    ckpt = config.checkpoint
    if ckpt.save is not None:
        if config.logging.log_progress:
            run.progress = ProgressLog(ckpt.save, dist.get_world_size(), dist.get_rank() == 0)
        committed = None if run.progress is None else functools.partial(
            run.progress.committed, async_save=ckpt.async_save)  # fmt: skip
        checkpointer = Checkpointer(ckpt.save, async_save=ckpt.async_save,
                                    keep_last=ckpt.ckpt_keep_last,
                                    retain_interval=ckpt.save_retain_interval,
                                    on_commit=committed)  # fmt: skip
    if config.training.moe_use_upcycling:
        loaded = upcycle_and_save(run, checkpointer)
    else:
        loaded = load_run_checkpoint(run)
    if run.progress is not None:
        run.progress.job_started(run.train.floating_point_operations_so_far, started)
    if loaded is not None and run.train.iteration == 0:
        metrics.print(f"fine-tuning from {loaded}")
    elif loaded is not None and config.training.moe_use_upcycling:
        metrics.print(f"upcycled {loaded} into a MoE model, saved at iteration 1 under "
                      f"{ckpt.save}")  # fmt: skip
    elif loaded is not None:
        metrics.print(
            f"resumed from {loaded} at iteration {run.train.iteration} "
            f"({run.train.consumed_train_samples} samples consumed)"
        )
    if checkpointer is not None and not config.training.skip_train:
        prepare_run_checkpointer(run, checkpointer)
    return checkpointer


def _non_persistent(run: Run, checkpointer: Checkpointer | None) -> Checkpointer | None:
    """The checkpointer of non_persistent_save_interval's saves: the newest one kept, the
    run's staging buffers shared."""
    ckpt = run.config.checkpoint
    if checkpointer is None or ckpt.non_persistent_save_interval is None:
        return None
    return checkpointer.sibling(ckpt.non_persistent_dir(ckpt.save), keep_last=1)


def _train(run: Run, forward_step_func, train_iter, valid_iter, checkpointers,
           cadence: Cadence, metrics, watchdog) -> Stop | None:  # fmt: skip
    """The iterations; returns why it stopped early, or None at the end of training.
    `checkpointers`: the run's and the non-persistent one (or None)."""
    checkpointer, non_persistent = checkpointers
    config = run.config
    if config.training.manual_gc:
        gc.disable()
        gc.collect()
    for chunk in run.model:
        chunk.train()
    train_step_func = forward_step_func
    if config.logging.log_straggler:  # evaluation's forward steps stay untimed
        train_step_func = timed_forward_step(forward_step_func, run.timers)
    step = _Step(run, train_step_func)
    train_iter = run.rerun.wrap(train_iter)
    profiler = StepProfiler(config.logging, dist.get_rank(), run.device)
    metrics.training_started()
    with cadence.during_training(), contextlib.closing(profiler):
        while not cadence.finished(run.train):
            profiler.iteration_started(run.train.iteration + 1)
            metrics.iteration_started()
            done = step(train_iter)
            if step.exit is not None:
                return _rerun_exit(run, step.exit, checkpointer, metrics, watchdog)
            if done is None:
                metrics.print(f"iteration {run.train.iteration} skipped (iterations_to_skip): "
                              "its global batch was read and not trained on")  # fmt: skip
            else:
                metrics.iteration_finished(*done)
            profiler.iteration_finished(run.train.iteration)
            watchdog.beat(run.train.iteration)
            _check_replicas(run, metrics)
            due = cadence.after_iteration(run.train)
            if due.synchronize and run.device.type == "cuda":
                torch.cuda.synchronize()
            if due.collect_garbage:
                gc.collect()
            if due.evaluate:
                collect = config.training.manual_gc and config.training.manual_gc_eval
                if collect:  # every object, before; what the evaluation made, after
                    gc.collect()
                with metrics.paused():  # not in the log line's time, as Megatron's
                    evaluate(run, forward_step_func, valid_iter, metrics, watchdog=watchdog,
                             time_is_up=cadence.time_is_up)  # fmt: skip
                if collect:
                    gc.collect(generation=0)
            if due.save or due.save_non_persistent:
                with watchdog.paused(), metrics.paused():
                    if due.save:
                        save_run_checkpoint(run, checkpointer)
                    else:
                        save_run_checkpoint(run, non_persistent, persistent=False)
            stop = cadence.stop(run.train.iteration, saved=due.save or due.save_non_persistent)
            if stop is not None:
                if stop.save:
                    with watchdog.paused():
                        save_run_checkpoint(run, checkpointer)
                metrics.print(f"exiting at iteration {run.train.iteration}: {stop.reason}")
                return stop
    return None


def _rerun_exit(run: Run, leaving, checkpointer, metrics, watchdog) -> Stop:
    """The rerun engine ends the run before the iteration's optimizer step (rerun.py),
    saving the iteration before first when the failure is to be run on other hardware."""
    if leaving.save:
        with watchdog.paused():
            save_run_checkpoint(run, checkpointer)
        run.rerun.saved()
    run.exit_code = leaving.code
    metrics.print(f"exiting with code {leaving.code} after iteration {run.train.iteration}: "
                  f"{leaving.reason}")  # fmt: skip
    return Stop(leaving.reason, save=False, exit_code=leaving.code)


def _check_replicas(run: Run, metrics: MetricsLogger) -> None:
    """--check-weight-hash-across-dp-replicas-interval's check, when due."""
    interval = run.config.training.check_weight_hash_across_dp_replicas_interval
    if interval and run.train.iteration % interval == 0:
        check_weight_replicas(run.model)
        metrics.print(f"weight hashes match across data-parallel replicas after "
                      f"{run.train.iteration} iterations")  # fmt: skip


class _Step:
    """One training iteration: the pipeline schedule's forward and backward over the
    global batch's micro-batches, the MoE parts around it, the NaN/skip policy, the
    optimizer and scheduler steps and the counters."""

    def __init__(self, run: Run, forward_step_func) -> None:
        config = run.config
        self.run, self.forward_step_func = run, forward_step_func
        self.schedule = schedule_of(run)
        microbatch_tokens = config.training.micro_batch_size * config.gpt.seq_length
        self.experts = MoEStep(config.model, run.model, run.state, config.optimizer.fp16,
                               config.optimizer.calculate_per_token_loss,
                               config.logging.moe_per_layer_logging, microbatch_tokens)  # fmt: skip
        self.skips = SkipPolicy(config.training, run.train)
        self.barrier = config.logging.barrier_with_L1_time
        self.rerun = run.rerun
        self.exit = None  # the rerun engine's Exit, when it ends the run
        self.skipped = set(config.training.iterations_to_skip)
        tracked = config.training.result_rejected_tracker_filename
        if tracked is not None:
            from_file = iterations_to_skip(tracked)
            if from_file and dist.get_rank() == 0:
                log.warning("%s: iterations %s failed their checks repeatably: skipping them",
                            tracked, from_file)  # fmt: skip
            self.skipped |= set(from_file)

    def __call__(self, train_iter) -> tuple[dict[str, float], Any, int, int] | None:
        """Runs it; returns the losses, the optimizer step's result (None: skipped), the
        global batch and its micro-batches. None: the iteration was skipped
        (iterations_to_skip), or the rerun engine ends the run (`exit`)."""
        run, timers, barrier = self.run, self.run.timers, self.barrier
        global_batch = run.calculator.global_batch(run.train.consumed_train_samples)
        num_microbatches = run.calculator.num_microbatches(run.train.consumed_train_samples)
        if run.train.iteration + 1 in self.skipped:
            _drop_batch(train_iter, num_microbatches)
            run.train.iteration += 1
            run.train.consumed_train_samples += global_batch
            run.train.skipped_train_samples += global_batch
            return None
        for attempt in self.rerun.attempts(run.train.iteration + 1):
            if attempt.number > 1:  # the first run's logged losses are not this one's
                self.experts.discard()
                discard_mtp_losses(run.model)
                discard_indexer_losses(run.model)
            step_func = self.forward_step_func
            if self.rerun.watching:
                step_func = attempt.watch(step_func)
            run.optimizer.zero_grad()
            self.experts.before(run.optimizer, num_microbatches)
            timers("forward-backward", log_level=1).start(barrier=barrier)
            reports = self.schedule(
                forward_step_func=step_func, data_iterator=train_iter,
                model=run.model, num_microbatches=num_microbatches, config=run.pipeline,
                pp_group=run.state.pp,
            )  # fmt: skip
            timers("forward-backward", log_level=1).stop()
            empty_unused_memory(run, level=1)
        self.exit = self.rerun.exit
        if self.exit is not None:
            return None
        self.experts.after_backward()
        losses = reduce_reports(reports) | self.experts.aux_losses(num_microbatches)
        losses |= mtp_losses(run.model, run.config.model, run.state, num_microbatches)
        losses |= indexer_losses(run.model, run.config.model, run.state, num_microbatches)
        # A global batch without loss tokens has zero gradients and steps, as in
        # Megatron-LM; its loss (0 / 0) is logged nan, but is no nan loss to stop at.
        uncounted = counted_nothing(reports)
        if uncounted and run.is_last_rank:
            log.warning("iteration %d: the global batch holds no loss tokens (every sample's "
                        "loss mask is 0): its gradients are zero, its %s logged as nan",
                        run.train.iteration + 1, ", ".join(sorted(uncounted)))  # fmt: skip
        checked = {name: value for name, value in losses.items() if name not in uncounted}
        result = None
        if self.skips.takes_step(checked, run.train.iteration + 1):
            timers("optimizer", log_level=1).start(barrier=barrier)
            result = run.optimizer.step()
            timers("optimizer", log_level=1).stop()
        largest = clip_after_step(run, stepped=result is not None and result.update_successful)
        if largest is not None:
            losses["max_attention_logit"] = largest
        empty_unused_memory(run, level=2)
        run.train.iteration += 1
        run.train.consumed_train_samples += global_batch
        run.train.skipped_train_samples += run.calculator.shortfall
        if self.skips.updated(result):
            run.scheduler.step(increment=global_batch)
        return losses, result, global_batch, num_microbatches


def _drop_batch(train_iter, num_microbatches: int) -> None:
    """Reads a global batch's micro-batches and drops them (every chunk's iterator with
    virtual stages; nothing on a rank that reads no data)."""
    for iterator in train_iter if isinstance(train_iter, list) else [train_iter]:
        if iterator is not None:
            for _ in range(num_microbatches):
                next(iterator)
