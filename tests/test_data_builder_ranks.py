"""mp-data's builder under torch.distributed: rank 0 builds, the others read its cache, with
one builder thread per rank and with several (--num-dataset-builder-threads)."""

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from mp_data import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDatasetBuilder,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def write_corpus(prefix: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(80):
        builder.add_item(np.append(rng.integers(2, 100, rng.integers(1, 30)), 0))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def build_on_ranks(prefixes: list[str], cache: str, skip_rank: int | None, threads: int):
    config = GPTDatasetConfig(
        random_seed=5, sequence_length=8, blend=(prefixes, [1.0, 3.0]), split="9,1,0",
        tokenizer=SimpleNamespace(vocab_size=100, eod=0, pad=1), path_to_cache=cache,
        create_attention_mask=False, num_dataset_builder_threads=threads,
    )  # fmt: skip
    rank = dist.get_rank()
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [200, 20, 0], lambda: rank != skip_rank, config
    ).build()
    if train is None:
        return None
    digest = hashlib.sha256(np.asarray(train.dataset_index).tobytes())
    for part in train.datasets:
        digest.update(np.asarray(part.shuffle_index).tobytes())
    return digest.hexdigest(), isinstance(train.dataset_index, np.memmap), len(valid)


@pytest.mark.parametrize("threads", [1, 3])
def test_rank_zero_builds_and_the_others_read_its_cache(tmp_path, threads):
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, prefix in enumerate(prefixes):
        write_corpus(prefix, seed)
    cache = str(tmp_path / "cache")
    results = run_on_ranks(build_on_ranks, 3, prefixes, cache, 2, threads, timeout=120)
    assert results[2] is None  # not built on that rank, yet it joined every barrier
    (digest0, mapped0, valid0), (digest1, mapped1, valid1) = results[0], results[1]
    assert digest0 == digest1 and valid0 == valid1
    assert mapped0 and mapped1  # rank 0 saved then mapped; rank 1 only mapped
    assert len(list((tmp_path / "cache").glob("*-description.txt"))) == 2 * 2 + 2
