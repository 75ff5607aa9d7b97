"""The datasets of a --mock-data run are megatron-core's: split 1,1,1 whatever `split` says,
and no data file is read."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import torch

from mp_data import MockGPTDataset, build_tokenizer
from mp_gpt.gpt import datasets_provider
from mp_train import parse_config


def test_mock_data_splits_evenly_as_megatron(tmp_path):
    settings = tmp_path / "run.yaml"  # its data path is not read under --mock-data
    settings.write_text("data_path: [/nonexistent/corpus_text_document]\n")
    config = parse_config([
        "--config", str(settings),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--split", "969,30,1",
        "--mid-level-dataset-surplus", "0.02", "--num-dataset-builder-threads", "3",
    ])  # fmt: skip
    assert config.data.data_path == ["/nonexistent/corpus_text_document"]
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
        assert dataset.config.mid_level_dataset_surplus == 0.02
        assert dataset.config.num_dataset_builder_threads == 3
        np.testing.assert_array_equal(dataset.indices, np.arange(lo, hi))


def test_mock_data_ends_documents_with_the_null_tokenizers_eod():
    """megatron-core's NullTokenizer: --vocab-size 1000 ends each mock document with 999;
    a pad shared with it masks those labels only with --allow-ambiguous-pad-tokens."""
    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
        "--null-tokenizer-pad-id", "999",
    ]  # fmt: skip
    first_rank = SimpleNamespace(rank=0, size=1)
    labels, masks = [], []
    for allow in ([], ["--allow-ambiguous-pad-tokens"]):
        config = parse_config(argv + allow)
        tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000, null_tokenizer_pad_id=999)
        assert (tokenizer.eod, tokenizer.pad) == (999, 999)
        run = SimpleNamespace(config=config, state=SimpleNamespace(pp=first_rank, tp=first_rank),
                              tokenizer=tokenizer)  # fmt: skip
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            train = datasets_provider(run, [400, 4, 4])[0]
        assert bool(warned) == bool(allow)  # the shared pad is named when it is used
        document = train.dataset[1]  # 1 .. n-1 (mod 1000), then the eod
        assert document[-1] == 999
        assert document[:-1].tolist() == [i % 1000 for i in range(1, len(document))]
        labels.append(torch.stack([train[i]["labels"] for i in range(400)]))
        masks.append(torch.stack([train[i]["loss_mask"] for i in range(400)]))
    eods = labels[0] == 999
    assert eods.any() and masks[0].all()
    assert torch.equal(masks[1] == 0, eods)
