"""The pretraining data loader: a dataset, a sampler for this data-parallel rank, a DataLoader.

build_pretraining_data_loader is Megatron-LM's function of the same name with
its global arguments made explicit: the caller (mp-train) passes the
micro-batch size and this rank's place in the data-parallel group, so mp-data
needs nothing of mp-state. dataloader_type picks the sampler:

    single    MegatronPretrainingSampler: one pass, in order, resumable
    cyclic    MegatronPretrainingRandomSampler: shuffled epochs, resumable
    external  none: the dataset is already an iterable of batches, returned as is
"""

from __future__ import annotations

import torch

from mp_data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

__all__ = ["DATALOADER_TYPES", "build_pretraining_data_loader"]

DATALOADER_TYPES = ("single", "cyclic", "external")


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    *,
    dataloader_type: str,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    data_sharding: bool = True,
    drop_last: bool = True,
    pin_memory: bool = False,
):
    """A DataLoader yielding this rank's micro-batches after consumed_samples; None for no dataset.

    data_sharding applies to "cyclic" only, drop_last to "single" only (the
    cyclic sampler always drops a short last micro-batch).
    """
    # Checked before the None case, so a misspelt type fails on every rank
    # and split, not only where a dataset happens to exist.
    if dataloader_type not in DATALOADER_TYPES:
        raise ValueError(
            f"dataloader_type={dataloader_type!r} is not one of {', '.join(DATALOADER_TYPES)}"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must not be negative")
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            drop_last=drop_last,
        )
    else:
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset,
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            data_sharding=data_sharding,
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Workers that outlive an epoch spare their start-up on every cyclic
        # epoch. They keep the dataset copy they started with, so a
        # RandomSeedDataset in them stays at the epoch the loader started in
        # (as in Megatron-LM).
        persistent_workers=num_workers > 0,
    )
