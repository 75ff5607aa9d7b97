"""Gradient buffer layout: order, buckets, views, padding and distributed-optimizer shards."""

import math

import pytest
import torch

from mp_optim import GradBuffer


def params(*shapes):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]


def test_layout_and_views():
    ps = params((3, 4), (5,), (2, 6))
    buffer = GradBuffer(ps, torch.float32, bucket_size=None, dp_size=1, shard_for_dp=False)
    assert [(r.start, r.end) for r in buffer.ranges.values()] == [(0, 12), (12, 17), (17, 29)]
    assert buffer.numel == 29 and len(buffer.buckets) == 1
    assert buffer.param_data is None
    for p in ps:
        where = buffer.ranges[p]
        p.main_grad.fill_(float(where.start))
        assert p.main_grad.data_ptr() == buffer.grad_data[where.start :].data_ptr()
    assert buffer.grad_data[12:17].eq(12).all() and buffer.grad_data[17:].eq(17).all()


def test_buckets_close_at_bucket_size():
    ps = params((10,), (10,), (10,), (25,), (3,))
    buffer = GradBuffer(ps, torch.float32, bucket_size=20, dp_size=1, shard_for_dp=False)
    assert [len(b.params) for b in buffer.buckets] == [2, 2, 1]
    assert [(b.offset, b.numel) for b in buffer.buckets] == [(0, 20), (20, 35), (55, 3)]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_every_element_in_exactly_one_shard(dp):
    ps = params((7, 30), (130,), (5, 5), (300,), (1,))
    buffer = GradBuffer(ps, torch.float32, bucket_size=200, dp_size=dp, shard_for_dp=True)
    for bucket in buffer.buckets:
        assert bucket.numel % math.lcm(128, dp) == 0
    covered = torch.zeros(buffer.numel, dtype=torch.int64)
    for rank in range(dp):
        for bucket in buffer.buckets:
            shard = bucket.shard(rank, dp)
            covered[shard.start : shard.end] += 1
    assert covered.eq(1).all()
    # The parameters' data now lives in the parameter buffer with the same layout.
    for p in ps:
        where = buffer.ranges[p]
        assert p.data.data_ptr() == buffer.param_data[where.start :].data_ptr()


def test_shard_for_dp_keeps_values():
    ps = params((4, 3), (6,))
    before = [p.detach().clone() for p in ps]
    GradBuffer(ps, torch.float32, bucket_size=None, dp_size=2, shard_for_dp=True)
    for p, b in zip(ps, before, strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)


def test_one_dtype_per_buffer():
    mixed = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).half())]
    with pytest.raises(ValueError, match="one parameter dtype"):
        GradBuffer(mixed, torch.float32, bucket_size=None, dp_size=1, shard_for_dp=False)


def test_a_tied_embedding_has_a_bucket_of_its_own_when_sharded():
    """The first stage's embedding and the last stage's copy, each among other parameters
    in its buffer: sharded over dp, each copy's bucket holds it alone, so both shard it
    alike (dp rank r holds the same elements of each); the embedding group's all-reduce
    after the reduce-scatter sums reduced rows with reduced rows. Unsharded (DDP's
    all-reduce), the buckets stay as they were."""
    first = params((3, 40), (300,), (5, 5))  # layers..., the embedding (backward order)
    last = params((300,), (2, 2), (7,))  # the output layer's copy, layers...
    dp, shards = 4, []
    for ps, tied, buckets in ((first, first[1], 3), (last, last[0], 2)):
        tied.shared_embedding = True
        buffer = GradBuffer(ps, torch.float32, bucket_size=None, dp_size=dp, shard_for_dp=True)
        assert len(buffer.buckets) == buckets, buffer.buckets
        bucket = buffer.bucket_of[tied]
        assert len(bucket.params) == 1 and buffer.ranges[tied].start == bucket.offset
        shards.append([(bucket.shard(r, dp).start - bucket.offset,
                        bucket.shard(r, dp).end - bucket.offset) for r in range(dp)])  # fmt: skip
    assert shards[0] == shards[1]
    again = params((3, 40), (300,), (5, 5))
    again[1].shared_embedding = True
    plain = GradBuffer(again, torch.float32, bucket_size=None, dp_size=dp, shard_for_dp=False)
    assert len(plain.buckets) == 1
