"""Full validation (Megatron's --full-validation, --multiple-validation-sets): each
evaluation reads every validation set whole, from its start, each sample once; the test
split, evaluated once at the end, is read whole too.

A set is the validation split (or, with multiple_validation_sets, one dataset of
valid_data_path, built on its own), built as one epoch; it is read in global batches of
the evaluation's size, the last one filled with samples that count no loss
(mp_data.PaddedToBatches), so its loss is the mean over exactly its samples' tokens.
Megatron-LM reads one sample per rank and micro-batch and cycles the ranks that run out
(a sample may count twice); here every rank reads eval micro-batches, and the number of
global batches, the same on every rank, comes from rank 0, which builds the datasets.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mp_data import PaddedToBatches, build_pretraining_data_loader
from mp_train.loop.signals import workers_ignored_signals

__all__ = ["FullValidation", "validation_suffixes"]


def validation_suffixes(run) -> list[str]:
    """Each validation set's suffix in the log and TensorBoard: "" for the one set, or
    "-<name>" (validation_set_names, else its index) with multiple_validation_sets."""
    training = run.config.training
    if not training.multiple_validation_sets:
        return [""]
    names = training.validation_set_names
    return [f"-{names[i] if names else i}" for i in range(len(run.config.data.valid_data_path))]


class FullValidation:
    """Sets read whole with full_validation: `sets` (log suffix, padded dataset or None on
    ranks that read none), `batches` (each set's global batches). `suffixes`: one per set,
    alike on every rank; `datasets`: rank 0's (None on ranks that read no data)."""

    def __init__(self, run, datasets: list | None, suffixes: list[str]) -> None:
        training = run.config.training
        count = len(suffixes)
        self.global_batch = training.eval_global_batch_size or run.calculator.global_batch_size
        self.micro_batch = training.eval_micro_batch_size or training.micro_batch_size
        lengths = torch.zeros(count, dtype=torch.float64)
        if datasets is not None:
            lengths = torch.tensor([float(len(d)) for d in datasets], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            lengths = lengths.cuda()
        dist.broadcast(lengths, src=0)  # rank 0 builds the datasets
        self.batches = [math.ceil(n / self.global_batch) for n in lengths.tolist()]
        padded = [None] * count if datasets is None else [
            PaddedToBatches(d, self.global_batch) for d in datasets]  # fmt: skip
        self.sets = list(zip(suffixes, padded, strict=True))

    def iterators(self, run, index: int) -> list:
        """Set `index`'s iterator from its start, one per model chunk with virtual stages
        (each chunk reads the same micro-batches); None where this rank reads no data.
        The caller closes them (their worker processes)."""
        _, dataset = self.sets[index]
        chunks = run.config.parallel.virtual_pipeline_model_parallel_size or 1
        if dataset is None:
            return [None] * chunks
        dp = run.state.dp
        return [iter(build_pretraining_data_loader(
            dataset, 0, dataloader_type="single", micro_batch_size=self.micro_batch,
            data_parallel_rank=dp.rank, data_parallel_size=dp.size,
            num_workers=run.config.data.num_workers,
            worker_ignored_signals=workers_ignored_signals(run.config.training),
        )) for _ in range(chunks)]  # fmt: skip
