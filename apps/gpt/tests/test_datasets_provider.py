"""The datasets of a --mock-data run are megatron-core's: split 1,1,1 whatever `split` says,
and no data file is read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mp_data import MockGPTDataset, build_tokenizer
from mp_gpt.gpt import datasets_provider
from mp_train import parse_config


def test_mock_data_splits_evenly_as_megatron():
    config = parse_config([
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--split", "969,30,1",
        "--data-path", "/nonexistent/corpus_text_document",  # a YAML file's, say: not read
    ])  # fmt: skip
    first_rank = SimpleNamespace(rank=0, size=1)
    run = SimpleNamespace(
        config=config,
        state=SimpleNamespace(pp=first_rank, tp=first_rank),
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=1000),
    )
    datasets = datasets_provider(run, [8, 4, 4])
    # 100,000 mock sequences cut at 1/3 and 2/3 (megatron-core's MockGPTLowLevelDataset).
    bounds = [(0, 33333), (33333, 66667), (66667, 100000)]
    for dataset, (lo, hi) in zip(datasets, bounds, strict=True):
        assert isinstance(dataset, MockGPTDataset)
        assert dataset.config.split == "1,1,1"
        np.testing.assert_array_equal(dataset.indices, np.arange(lo, hi))
