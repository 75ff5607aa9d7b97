"""Pretraining batch samplers: which sample indices each data-parallel rank reads.

Both samplers are batch samplers for a torch DataLoader: each item they yield
is one micro-batch, a list of micro_batch_size sample indices, for this rank.
A global batch step takes micro_batch_size * data_parallel_size samples,
one micro-batch per data-parallel rank, and `consumed_samples` counts samples
over all ranks, as Megatron-LM's training loop does; a run that resumes with
the consumed_samples of its checkpoint reads exactly the samples the
uninterrupted run would have read next.

MegatronPretrainingSampler ("single") reads the dataset once, in order: the
global batch is a run of consecutive indices and rank r takes the r-th slice.
The dataset is already shuffled (GPTDataset's shuffle index), so order here
only has to be reproducible.

MegatronPretrainingRandomSampler ("cyclic") reads the dataset epoch after
epoch, each epoch in a new order drawn from a torch generator seeded with the
epoch number, so the order depends only on (epoch, sizes), never on the
process's random state. With data_sharding, rank r keeps to its own
contiguous bucket of the samples and only shuffles within it; without, one
permutation of all samples is dealt out to the ranks round-robin.
RandomSeedDataset is its companion: the sampler tells it the epoch, and it
reseeds the random generators before each item so that random data
augmentation is reproducible per (epoch, sample).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["MegatronPretrainingRandomSampler", "MegatronPretrainingSampler", "RandomSeedDataset"]


def _check_layout(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be positive")
    if data_parallel_size <= 0:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank={data_parallel_rank} is not in "
            f"[0, data_parallel_size={data_parallel_size})"
        )


class MegatronPretrainingSampler:
    """Consecutive global batches from consumed_samples to total_samples; this rank's slice.

    A last global batch shorter than micro_batch_size * data_parallel_size is
    dropped, or with drop_last=False yielded as this rank's slice of it, which
    may be short or empty (a rank past its end). len() is total_samples, as in
    Megatron-LM: the number of samples, not of batches.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples} must be positive")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} is not in [0, total_samples={total_samples})"
            )
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.global_batch_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        end = start + self.micro_batch_size
        # Global batches are aligned to consumed_samples, not to 0: a run that
        # resumed from a count that is not a multiple of the global batch
        # (e.g. after the batch size changed) goes on from exactly there.
        for first in range(self.consumed_samples, self.total_samples, self.global_batch_size):
            last = min(first + self.global_batch_size, self.total_samples)
            if last - first < self.global_batch_size and self.drop_last:
                return
            yield list(range(first, last))[start:end]


class RandomSeedDataset(torch.utils.data.Dataset):
    """`dataset`, with torch, numpy and python's random reseeded before each item.

    Item idx of epoch e is read right after seeding all three with
    seed + e + idx, so whatever randomness the wrapped dataset draws is the same
    on every run and every rank. The epoch is set by
    MegatronPretrainingRandomSampler when it starts one.
    """

    def __init__(self, dataset, seed: int) -> None:
        self.dataset = dataset
        self.base_seed = seed
        self.curr_seed = seed

    def set_epoch(self, epoch: int) -> None:
        self.curr_seed = self.base_seed + epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        seed = idx + self.curr_seed
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        return self.dataset[idx]


class MegatronPretrainingRandomSampler:
    """Endless epochs of shuffled micro-batches for this rank, resumable at any global batch.

    Each epoch reads active_total = total_samples rounded down to a multiple of
    the global batch (micro_batch_size * data_parallel_size) samples;
    consumed_samples // active_total is the epoch and the remainder the place
    in it, which must fall on a global batch boundary. Iterating reads the rest
    of the current epoch and advances consumed_samples by one global batch per
    micro-batch yielded, so iterating again starts the next epoch.

    With data_sharding, rank r draws from its own bucket
    [r * bucket_size, (r + 1) * bucket_size), bucket_size = active_total /
    data_parallel_size, in an order that is the same permutation on every rank
    (seeded by the epoch), shifted to the bucket.

    Without data_sharding, one permutation of the first total_samples rounded
    down to a multiple of micro_batch_size samples is dealt round-robin to the
    ranks. As in Megatron-LM, when that is more than active_total the extra
    samples make the ranks' shares unequal: the first ranks may get one more
    micro-batch in an epoch than the last ones.
    """

    def __init__(
        self,
        dataset,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples} must be positive")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must not be negative")
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.global_batch_size = micro_batch_size * data_parallel_size
        if total_samples < self.global_batch_size:
            raise ValueError(
                f"total_samples={total_samples} is less than one global batch of "
                f"micro_batch_size={micro_batch_size} * data_parallel_size={data_parallel_size}"
            )
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.last_batch_size = total_samples % self.global_batch_size
        self.epoch = 0
        self._position()  # a misaligned consumed_samples fails here, not at the first batch

    def __len__(self) -> int:
        return self.total_samples

    def _position(self) -> tuple[int, int]:
        """(epoch, samples of it already consumed) for the current consumed_samples."""
        active_total = self.total_samples - self.last_batch_size
        epoch, in_epoch = divmod(self.consumed_samples, active_total)
        if in_epoch % self.global_batch_size:
            raise ValueError(
                f"consumed_samples={self.consumed_samples} is {in_epoch} samples into epoch "
                f"{epoch}, not a multiple of micro_batch_size * data_parallel_size="
                f"{self.global_batch_size}"
            )
        return epoch, in_epoch

    def _epoch_indices(self, epoch: int, in_epoch: int) -> torch.Tensor:
        """This rank's remaining sample indices of the epoch, in reading order (int64).

        Kept as a tensor: each micro-batch becomes a list only when it is yielded. A
        list of the whole epoch (Megatron-LM's) costs 36 bytes a sample, 3.6 GB for 100
        million samples, and 30 ms for the 3.2 million of a short test run."""
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.global_batch_size) * self.micro_batch_size
            bucket_start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=generator)
            # Each rank has read in_epoch / dp samples of its own bucket.
            return order[in_epoch // self.data_parallel_size :] + bucket_start
        full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        order = torch.randperm(full_bucket_size, generator=generator)
        return order[in_epoch:][self.data_parallel_rank :: self.data_parallel_size]

    def __iter__(self) -> Iterator[list[int]]:
        # Everything up to the first batch runs now, not lazily in the
        # generator: a DataLoader calls iter() before it starts its workers, so
        # they are forked with the dataset's epoch already set.
        self.epoch, in_epoch = self._position()
        if isinstance(self.dataset, RandomSeedDataset):
            self.dataset.set_epoch(self.epoch)
        return self._batches(self._epoch_indices(self.epoch, in_epoch))

    def _batches(self, indices: torch.Tensor) -> Iterator[list[int]]:
        mbs = self.micro_batch_size
        for first in range(0, len(indices) - mbs + 1, mbs):  # a short last batch is dropped
            self.consumed_samples += self.global_batch_size
            yield indices[first : first + mbs].tolist()
