"""Samplers and the data loader: every rank's share, resumption, epochs, batches."""

import random

import numpy as np
import pytest
import torch

from mp_data.data_loader import build_pretraining_data_loader
from mp_data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    RandomSeedDataset,
)

# (total_samples, micro_batch_size, data_parallel_size); several leave a partial
# last global batch, one is smaller than a global batch.
LAYOUTS = [(16, 2, 2), (17, 2, 2), (30, 3, 4), (7, 1, 8), (100, 4, 8), (9, 1, 1), (5, 2, 4)]


def sequential(total, consumed, mbs, dp, drop_last=True) -> list[list[list[int]]]:
    """Each rank's micro-batches from MegatronPretrainingSampler."""
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last))
            for r in range(dp)]  # fmt: skip


def cyclic(total, consumed, mbs, dp, sharding, dataset=None) -> list[list[list[int]]]:
    """Each rank's micro-batches of one pass of MegatronPretrainingRandomSampler."""
    return [list(MegatronPretrainingRandomSampler(dataset, total, consumed, mbs, r, dp, sharding))
            for r in range(dp)]  # fmt: skip


def interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """The global read order: step by step, rank 0's micro-batch, then rank 1's, ..."""
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks read different numbers of micro-batches: {steps}"
    return [i for step in zip(*per_rank, strict=True) for batch in step for i in batch]


# Sequential sampler ("single").


@pytest.mark.parametrize("total,mbs,dp", LAYOUTS)
@pytest.mark.parametrize("consumed", [0, 3])
def test_sequential_ranks_together_read_in_order_up_to_the_last_full_global_batch(
    total, mbs, dp, consumed
):
    if consumed >= total:
        pytest.skip("nothing left to read")
    gbs = mbs * dp
    end = consumed + (total - consumed) // gbs * gbs
    per_rank = sequential(total, consumed, mbs, dp)
    assert interleave(per_rank) == list(range(consumed, end))
    assert all(len(b) == mbs for batches in per_rank for b in batches)
    assert len(MegatronPretrainingSampler(total, consumed, mbs, 0, dp)) == total


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_sequential_resumes_at_any_global_batch_with_nothing_skipped_or_repeated(dp):
    total, mbs = 70, 2
    gbs = mbs * dp
    uninterrupted = interleave(sequential(total, 0, mbs, dp))
    for consumed in range(0, total, gbs):
        assert interleave(sequential(total, consumed, mbs, dp)) == uninterrupted[consumed:]


def test_sequential_without_drop_last_yields_each_ranks_slice_of_the_tail():
    # 11 samples, global batch 8: one full batch, then [8, 9, 10] split 2/1/0/0.
    per_rank = sequential(11, 0, 2, 4, drop_last=False)
    assert per_rank == [[[0, 1], [8, 9]], [[2, 3], [10]], [[4, 5], []], [[6, 7], []]]
    assert sequential(11, 0, 2, 4, drop_last=True) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    # No tail, nothing extra.
    assert sequential(16, 0, 2, 4, drop_last=False) == sequential(16, 0, 2, 4)


# Random sampler ("cyclic").

CYCLIC_LAYOUTS = [(16, 2, 2), (17, 2, 2), (30, 3, 4), (64, 2, 8), (40, 1, 1), (23, 1, 4)]


def epoch_reads(total, mbs, dp, sharding, epoch):
    """Per rank, the samples read in `epoch`, from a sampler started at its beginning."""
    active = total - total % (mbs * dp)
    per_rank = cyclic(total, epoch * active, mbs, dp, sharding)
    return [[i for batch in batches for i in batch] for batches in per_rank]


@pytest.mark.parametrize("total,mbs,dp", CYCLIC_LAYOUTS)
@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_sharded_epoch_is_a_permutation_of_the_active_samples_each_rank_in_its_bucket(
    total, mbs, dp, epoch
):
    active = total - total % (mbs * dp)
    bucket = active // dp
    reads = epoch_reads(total, mbs, dp, True, epoch)
    assert sorted(i for rank in reads for i in rank) == list(range(active))
    for r, rank_reads in enumerate(reads):
        assert len(rank_reads) == bucket
        assert all(r * bucket <= i < (r + 1) * bucket for i in rank_reads)


@pytest.mark.parametrize("total,mbs,dp", CYCLIC_LAYOUTS)
@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_unsharded_epoch_deals_distinct_samples_to_the_ranks(total, mbs, dp, epoch):
    active = total - total % (mbs * dp)
    full = total // mbs * mbs  # Megatron permutes these, which may be more than active
    reads = epoch_reads(total, mbs, dp, False, epoch)
    flat = [i for rank in reads for i in rank]
    assert len(flat) == len(set(flat))
    assert all(0 <= i < full for i in flat)
    if full == active:
        assert sorted(flat) == list(range(active))
        assert len({len(rank) for rank in reads}) == 1


def test_unsharded_extra_samples_give_the_first_ranks_an_extra_micro_batch():
    # Megatron's behaviour, kept for the same sample order: 6 samples permuted,
    # dealt to 4 ranks, ranks 0 and 1 read 2 micro-batches of 1, ranks 2 and 3 one.
    reads = epoch_reads(6, 1, 4, False, epoch=0)
    assert [len(rank) for rank in reads] == [2, 2, 1, 1]


@pytest.mark.parametrize("sharding", [True, False])
def test_epoch_order_is_deterministic_and_differs_between_epochs(sharding):
    total, mbs, dp = 64, 2, 4
    first = [epoch_reads(total, mbs, dp, sharding, e) for e in range(3)]
    again = [epoch_reads(total, mbs, dp, sharding, e) for e in range(3)]
    assert first == again
    assert first[0] != first[1] != first[2] != first[0]


@pytest.mark.parametrize("sharding", [True, False])
def test_order_is_megatrons_randperm_seeded_with_the_epoch(sharding):
    # Same seed and sizes as Megatron-LM, same samples: pinned to torch.randperm.
    total, mbs, dp, rank, epoch = 20, 2, 2, 1, 3
    g = torch.Generator().manual_seed(epoch)
    if sharding:
        bucket = total // (mbs * dp) * mbs
        expected = (torch.randperm(bucket, generator=g) + rank * bucket).tolist()
    else:
        expected = torch.randperm(total // mbs * mbs, generator=g)[rank::dp].tolist()
    sampler = MegatronPretrainingRandomSampler(None, total, epoch * total, mbs, rank, dp, sharding)
    assert [i for batch in sampler for i in batch] == expected


@pytest.mark.parametrize("total,mbs,dp", CYCLIC_LAYOUTS)
@pytest.mark.parametrize("sharding", [True, False])
def test_random_resumes_mid_epoch_with_exactly_the_rest_of_it(total, mbs, dp, sharding):
    gbs = mbs * dp
    active = total - total % gbs
    epoch = 2
    whole = cyclic(total, epoch * active, mbs, dp, sharding)
    for step in range(active // gbs):
        resumed = cyclic(total, epoch * active + step * gbs, mbs, dp, sharding)
        assert resumed == [batches[step:] for batches in whole]


@pytest.mark.parametrize("sharding", [True, False])
def test_iterating_again_continues_where_the_last_iteration_stopped(sharding):
    total, mbs, dp, rank = 24, 2, 3, 1
    gbs = mbs * dp
    sampler = MegatronPretrainingRandomSampler(None, total, 0, mbs, rank, dp, sharding)
    read = []
    for batch in sampler:  # stop after two micro-batches, as at a checkpoint
        read.append(batch)
        if len(read) == 2:
            break
    assert sampler.consumed_samples == 2 * gbs
    read += list(sampler)  # the rest of epoch 0
    assert sampler.consumed_samples == total
    read += list(sampler)  # all of epoch 1
    assert sampler.epoch == 1 and sampler.consumed_samples == 2 * total
    fresh = [MegatronPretrainingRandomSampler(None, total, e * total, mbs, rank, dp, sharding)
             for e in (0, 1)]  # fmt: skip
    assert read == list(fresh[0]) + list(fresh[1])


# RandomSeedDataset.


class Draws(torch.utils.data.Dataset):
    """Item idx: idx and one draw from each of torch, numpy and python's random."""

    def __len__(self):
        return 10

    def __getitem__(self, idx):
        return idx, torch.rand(()).item(), float(np.random.rand()), random.random()


def test_random_seed_dataset_draws_depend_only_on_epoch_and_index():
    data = RandomSeedDataset(Draws(), seed=1234)
    assert len(data) == 10
    first = [data[i] for i in range(10)]
    torch.rand(5), np.random.rand(5), random.random()  # state in between must not matter
    assert [data[i] for i in reversed(range(10))] == first[::-1]
    assert len({item[1:] for item in first}) == 10
    data.set_epoch(1)
    assert data.curr_seed == 1235
    second = [data[i] for i in range(10)]
    assert all(a[1:] != b[1:] for a, b in zip(first, second, strict=True))
    data.set_epoch(0)
    assert [data[i] for i in range(10)] == first


def test_random_sampler_sets_the_datasets_epoch_when_iteration_starts():
    data = RandomSeedDataset(Draws(), seed=7)
    sampler = MegatronPretrainingRandomSampler(data, 10, 20, 2, 0, 2, True)  # epoch 2
    assert data.curr_seed == 7
    iter(sampler)  # before any batch, so DataLoader workers fork with it set
    assert data.curr_seed == 9


# The data loader.


class Tokens(torch.utils.data.Dataset):
    """Item idx: a dict holding tokens [4], all equal to idx."""

    def __len__(self):
        return 21

    def __getitem__(self, idx):
        return {"tokens": torch.full((4,), idx, dtype=torch.long)}


def loader(dataloader_type, consumed=0, **overrides):
    kwargs = dict(dataloader_type=dataloader_type, micro_batch_size=3, data_parallel_rank=1,
                  data_parallel_size=2) | overrides  # fmt: skip
    return build_pretraining_data_loader(Tokens(), consumed, **kwargs)


def test_single_loader_gives_collated_micro_batches_of_this_ranks_samples():
    batches = list(loader("single", consumed=6))
    expected = MegatronPretrainingSampler(21, 6, 3, 1, 2)
    assert len(batches) == 2
    for batch, indices in zip(batches, expected, strict=True):
        assert batch["tokens"].shape == (3, 4)
        assert batch["tokens"][:, 0].tolist() == indices


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_loader_gives_collated_micro_batches_of_this_ranks_samples(sharding):
    batches = list(loader("cyclic", consumed=6, data_sharding=sharding))
    expected = MegatronPretrainingRandomSampler(None, 21, 6, 3, 1, 2, sharding)
    assert len(batches) == 2
    for batch, indices in zip(batches, expected, strict=True):
        assert batch["tokens"].shape == (3, 4)
        assert batch["tokens"][:, 0].tolist() == indices


def test_loader_with_workers_reads_the_same_batches_and_the_resumed_epochs_seeds():
    # Fresh datasets at epoch 0: the workers must see epoch 1 set before they start.
    kwargs = dict(dataloader_type="cyclic", micro_batch_size=2, data_parallel_rank=0,
                  data_parallel_size=1)  # fmt: skip
    main = build_pretraining_data_loader(RandomSeedDataset(Draws(), 3), 10, **kwargs)
    workers = build_pretraining_data_loader(RandomSeedDataset(Draws(), 3), 10, num_workers=2,
                                            **kwargs)  # fmt: skip
    in_main, in_workers = list(main), list(workers)  # epoch 1
    assert len(in_main) == 5
    for a, b in zip(in_main, in_workers, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def test_external_loader_is_the_dataset_and_no_dataset_gives_none():
    layout = dict(micro_batch_size=3, data_parallel_rank=0, data_parallel_size=1)
    ext = [{"tokens": torch.zeros(3, 4)}]
    assert build_pretraining_data_loader(ext, 0, dataloader_type="external", **layout) is ext
    for kind in ("single", "cyclic", "external"):
        assert build_pretraining_data_loader(None, 0, dataloader_type=kind, **layout) is None


# Invalid inputs.


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 2, 0, 1), "total_samples=0"),
        ((10, 10, 2, 0, 1), r"consumed_samples=10 is not in \[0, total_samples=10\)"),
        ((10, -1, 2, 0, 1), "consumed_samples=-1"),
        ((10, 0, 0, 0, 1), "micro_batch_size=0"),
        ((10, 0, 2, 0, 0), "data_parallel_size=0"),
        ((10, 0, 2, 2, 2), r"data_parallel_rank=2 is not in \[0, data_parallel_size=2\)"),
        ((10, 0, 2, -1, 2), "data_parallel_rank=-1"),
    ],
)
def test_sequential_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 0, 2, 0, 1), "total_samples=0"),
        ((10, -2, 2, 0, 1), "consumed_samples=-2"),
        ((10, 0, 0, 0, 1), "micro_batch_size=0"),
        ((10, 0, 2, 0, -1), "data_parallel_size=-1"),
        ((10, 0, 2, 3, 2), "data_parallel_rank=3"),
        ((3, 0, 2, 0, 2), "total_samples=3 is less than one global batch"),
        ((10, 6, 2, 0, 2), "consumed_samples=6 is 6 samples into epoch 0"),
        ((10, 14, 2, 0, 2), "consumed_samples=14 is 6 samples into epoch 1"),
    ],
)
def test_random_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingRandomSampler(None, *args, data_sharding=True)


def test_random_sampler_rejects_a_misaligned_count_set_after_construction():
    sampler = MegatronPretrainingRandomSampler(None, 10, 0, 2, 0, 2, True)
    sampler.consumed_samples = 2
    with pytest.raises(ValueError, match="consumed_samples=2"):
        iter(sampler)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dataloader_type": "bogus"}, "dataloader_type='bogus' is not one of single, cyclic"),
        ({"dataloader_type": "single", "num_workers": -1}, "num_workers=-1"),
        ({"dataloader_type": "single", "data_parallel_rank": 5}, "data_parallel_rank=5"),
    ],
)
def test_loader_rejects_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        loader(**overrides)
