"""Megatron-LM's --ddp-num-buckets: with --overlap-grad-reduce the gradient buckets are this
rank's parameters / N each (Megatron's resolution), the curve stays the one-bucket run's;
without overlap it changes nothing; beside --ddp-bucket-size it is refused."""

import pytest

from mp_gpt.testing import metrics_records, tiny_options, train_run_on_rank
from mp_state.testing import run_on_ranks
from mp_train import parse_config

pytestmark = pytest.mark.multirank


def buckets_on_rank(argv: list[str]) -> tuple[int, list[int]]:
    """(this rank's parameters, its buckets' sizes in elements)."""
    run = train_run_on_rank(argv)
    chunk = run.model[0]
    return sum(p.numel() for p in chunk.parameters()), [b.numel for b in chunk.buckets]


def test_num_buckets_sizes_the_buckets_and_keeps_the_curve(tmp_path):
    (params, one), _ = run_on_ranks(buckets_on_rank, 2, tiny_options(tmp_path / "one"))
    assert len(one) == 1
    overlap = ["--overlap-grad-reduce", "--ddp-num-buckets", "4"]
    (same, sizes), _ = run_on_ranks(buckets_on_rank, 2, tiny_options(tmp_path / "four", *overlap))
    # a bucket closes at the first parameter that takes it to params // 4 or more
    assert same == params and 4 <= len(sizes) <= 5 and sum(sizes) >= params
    assert all(size >= params // 4 for size in sizes[:-1])
    plain, bucketed = metrics_records(tmp_path / "one"), metrics_records(tmp_path / "four")
    assert [r["lm loss"] for r in bucketed] == [r["lm loss"] for r in plain]
    no_overlap = tiny_options(tmp_path / "no", "--ddp-num-buckets", "4")
    (_, sizes), _ = run_on_ranks(buckets_on_rank, 2, no_overlap)
    assert len(sizes) == 1


def test_num_buckets_beside_a_bucket_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    flags = ["--ddp-num-buckets", "4", "--ddp-bucket-size", "1000"]
    with pytest.raises(ValueError, match="num_buckets=4 with bucket_size=1000: give one"):
        parse_config(tiny_options(tmp_path, *flags))
