"""A run's training, validation and test iterators: datasets_provider(run, [train,
valid, test] sample counts) and mp-data's loaders, which start after the consumed samples
(of the current phase, with phase_transition_iterations: phases.py), one per model chunk
with virtual stages; rank 0 tells the ranks that read no data what exists."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from mp_data import build_pretraining_data_loader, train_valid_test_num_samples
from mp_train.loop.full_validation import FullValidation, validation_suffixes
from mp_train.loop.phases import phase_samples
from mp_train.loop.setup import Run
from mp_train.loop.signals import workers_ignored_signals

__all__ = ["data_iterators"]

Iterators = Iterator | list | FullValidation | None


def data_iterators(run: Run, datasets_provider, opened: list
                   ) -> tuple[Iterators, Iterators, Callable[[], Iterators] | None]:  # fmt: skip
    """Train and validation iterators, one per model chunk with virtual stages (a
    FullValidation for the validation sets with full_validation), and what opens the test
    split's, once, at the end (None without test data: no worker process waits through the
    training for them). Each iterator of a loader mp-data built is appended to `opened` as
    it starts (its workers with it), for the caller to close."""
    training, data = run.config.training, run.config.data
    gbs = run.calculator.global_batch_size
    eval_gbs = training.eval_global_batch_size or gbs
    if training.train_iters is not None:
        counts = train_valid_test_num_samples(
            training.train_iters, eval_gbs, training.eval_interval or 0, training.eval_iters
        )
        counts[0] = run.calculator.samples_for(training.train_iters)  # a batch schedule's
        iterations = training.train_iters
    else:
        evaluations = (training.train_samples // gbs // training.eval_interval + 1
                       if training.eval_interval else 0)  # fmt: skip
        counts = [training.train_samples, evaluations * training.eval_iters * eval_gbs,
                  training.eval_iters * eval_gbs]  # fmt: skip
        iterations = training.train_samples // gbs
    if training.start_eval_at_iter and training.eval_interval:  # Megatron's count
        evaluations = max(0, iterations // training.eval_interval + 1
                          - training.start_eval_at_iter // training.eval_interval)  # fmt: skip
        counts[1] = evaluations * training.eval_iters * eval_gbs
    if training.full_validation:  # one epoch of each set, read whole each time
        counts[1] = counts[2] = None
    consumed = run.train.consumed_train_samples
    if training.phase_transitions:  # this phase's samples, read from its start
        counts[0], consumed = phase_samples(training.phase_transitions, gbs, counts[0],
                                            run.train.iteration)  # fmt: skip
    train_ds, valid_ds, test_ds = datasets_provider(run, counts)
    # Context-parallel ranks read the same samples (each keeps its part of every
    # sequence): the loaders split over data-parallel ranks only.
    dp = run.state.dp

    ignored = workers_ignored_signals(training)  # the training handles them (signals.py)

    def start(dataset, consumed, kind, micro_batch_size=training.micro_batch_size):
        if dataset is None:
            return None
        loader = build_pretraining_data_loader(
            dataset, consumed, dataloader_type=kind,
            micro_batch_size=micro_batch_size, data_parallel_rank=dp.rank,
            data_parallel_size=dp.size, num_workers=data.num_workers,
            worker_ignored_signals=ignored,
        )  # fmt: skip
        iterator = iter(loader)
        if kind != "external":  # an external dataset is the caller's own
            opened.append(iterator)
        return iterator

    # Ranks that read no data (tensor-parallel ranks > 0, middle stages) have no datasets
    # but take part in every step: rank 0, which reads, tells them what exists.
    full = training.full_validation
    if full and valid_ds is not None and not isinstance(valid_ds, list):
        valid_ds = [valid_ds]
    flags = torch.tensor([float(ds is not None) for ds in (train_ds, valid_ds, test_ds)])
    if dist.get_backend() == "nccl":
        flags = flags.cuda()
    dist.broadcast(flags, src=0)
    # As Megatron's do_valid and do_test: no evaluation without the split's data or with
    # eval_iters=0.
    run.has_train_data = bool(flags[0])
    run.has_valid_data = bool(flags[1]) and (full or training.eval_iters > 0)
    run.has_test_data = bool(flags[2]) and (full or training.eval_iters > 0)
    # With virtual stages each chunk draws the same micro-batches: a loader per chunk.
    vpp = run.config.parallel.virtual_pipeline_model_parallel_size
    train = [start(train_ds, consumed, data.dataloader_type) for _ in range(vpp or 1)]
    eval_mbs = training.eval_micro_batch_size or training.micro_batch_size

    def open_test():
        """The test split's iterators, from its start, as Megatron's (whole with full
        validation), opened at the end."""
        if full:
            return FullValidation(run, None if test_ds is None else [test_ds], [""])
        chunks = [start(test_ds, 0, data.dataloader_type, eval_mbs) for _ in range(vpp or 1)]
        return chunks[0] if vpp is None else chunks

    test = open_test if run.has_test_data else None
    if full:  # each evaluation reads the sets from their start (full_validation.py)
        valid = (FullValidation(run, valid_ds, validation_suffixes(run))
                 if run.has_valid_data else None)  # fmt: skip
        return (train[0] if vpp is None else train), valid, test
    # The validation split is read with the training's sampler, as in Megatron-LM ("single":
    # in order, each evaluation where the last stopped), so that every layout evaluates on
    # the same samples; it is sized for every evaluation of the run (train_valid_test_num_
    # samples). The shuffled sampler's order depends on the data-parallel size.
    # An evaluation-only run (skip_train) reads it from its start, as Megatron's does.
    consumed_valid = 0 if training.skip_train else run.train.consumed_valid_samples
    valid = [start(valid_ds, consumed_valid, data.dataloader_type, eval_mbs)
             for _ in range(vpp or 1)]  # fmt: skip
    if vpp is None:
        return train[0], valid[0], test
    return train, valid, test  # None in each chunk's place where this rank reads no data
