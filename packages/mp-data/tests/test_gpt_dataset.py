"""GPTDataset: samples are windows of the shuffled document stream; caching; items."""

import hashlib
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mp_data.gpt_dataset as gpt_module
from mp_data import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    MockGPTDataset,
    Split,
)

EOD, PAD, VOCAB = 0, 1, 100
TOKENIZER = SimpleNamespace(vocab_size=VOCAB, eod=EOD, pad=PAD)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """60 documents of 1-40 tokens, each closed by EOD, ids 2..99."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "c_text_document")
    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(60):
        body = rng.integers(2, VOCAB, rng.integers(0, 40))
        builder.add_item(np.append(body, EOD))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def config(tmp_path, **overrides) -> GPTDatasetConfig:
    kwargs = dict(random_seed=1234, sequence_length=16, tokenizer=TOKENIZER,
                  path_to_cache=str(tmp_path / "cache"), create_attention_mask=False)  # fmt: skip
    return GPTDatasetConfig(**(kwargs | overrides))


def make(corpus, tmp_path, num_samples=None, split=Split.train, ids=None, **overrides):
    ds = IndexedDataset(corpus)
    ids = np.arange(len(ds), dtype=np.int32) if ids is None else ids
    return GPTDataset(ds, corpus, ids, num_samples, split, config(tmp_path, **overrides))


def stream(gpt: GPTDataset) -> np.ndarray:
    return np.concatenate([gpt.dataset.get(int(d)) for d in gpt.document_index])


@pytest.mark.parametrize("num_samples", [None, 10, 80, 150, 400])
@pytest.mark.parametrize("extra", [True, False])
def test_samples_are_consecutive_windows_of_the_document_stream(corpus, tmp_path, num_samples,
                                                                 extra):  # fmt: skip
    gpt = make(corpus, tmp_path, num_samples, add_extra_token_to_sequence=extra)
    L, e = 16, int(extra)
    text = stream(gpt)
    assert len(gpt) == (len(text) - e) // L
    if num_samples is not None:
        assert len(gpt) >= num_samples
    for i in range(len(gpt)):
        j = int(gpt.shuffle_index[i])
        assert gpt.tokens_of(i).tolist() == text[j * L : j * L + L + e].tolist(), i
    assert sorted(gpt.shuffle_index.tolist()) == list(range(len(gpt)))


def test_epochs_and_the_separate_final_epoch(corpus, tmp_path):
    ds = IndexedDataset(corpus)
    tokens = int(ds.sequence_lengths.sum())
    per_epoch = (tokens - 1) // 16
    # Two full epochs and a little of a third: the third is shuffled on its own.
    gpt = make(corpus, tmp_path, 2 * per_epoch + 3)
    docs = gpt.document_index
    assert len(docs) == 3 * len(ds)
    assert sorted(docs[-len(ds) :].tolist()) == list(range(len(ds)))
    before_final = (2 * tokens - 1) // 16
    assert sorted(gpt.shuffle_index[:before_final].tolist()) == list(range(before_final))
    # Most of a second epoch used: shuffled together with the first.
    together = make(corpus, tmp_path, per_epoch + int(0.9 * per_epoch))
    assert len(together.document_index) == 2 * len(ds)
    assert sorted(together.document_index[len(ds) :].tolist()) != list(range(len(ds)))


def test_items(corpus, tmp_path):
    gpt = make(corpus, tmp_path, create_attention_mask=True)
    item = gpt[3]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}
    assert item["tokens"].shape == item["labels"].shape == (16,)
    assert item["tokens"].dtype == item["labels"].dtype == torch.int64
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert torch.equal(item["position_ids"], torch.arange(16))
    assert torch.equal(item["loss_mask"], torch.ones(16))
    assert torch.equal(item["attention_mask"], ~torch.ones(1, 16, 16, dtype=torch.bool).tril())
    assert gpt[None]["loss_mask"].sum() == 0  # a padding sample carries no loss


def test_items_with_document_resets(corpus, tmp_path):
    gpt = make(corpus, tmp_path, reset_position_ids=True, eod_mask_loss=True)
    for i in range(len(gpt)):
        item = gpt[i]
        eods = (item["tokens"] == EOD).nonzero().flatten().tolist()
        assert item["loss_mask"][eods].sum() == 0
        for k in eods:
            if k + 1 < 16:
                assert item["position_ids"][k + 1] == 0


def test_kept_partial_validation_sample_is_padded(corpus, tmp_path):
    gpt = make(corpus, tmp_path, split=Split.valid, drop_last_partial_validation_sequence=False)
    text_length = len(stream(gpt))
    assert len(gpt) == -(-(text_length - 1) // 16)  # the last, partial sample is kept
    last = next(i for i in range(len(gpt)) if int(gpt.shuffle_index[i]) == len(gpt) - 1)
    item = gpt[last]
    real = (text_length - 1) - 16 * (len(gpt) - 1)
    assert item["loss_mask"][real:].sum() == 0 and item["loss_mask"][:real].all()
    assert (item["labels"][real:] == 0).all()


def test_a_pad_shared_with_eod_is_used_only_when_allowed(corpus, tmp_path):
    """megatron-core's rule: a pad id that is also the eod (or bos) masks nothing, unless
    allow_ambiguous_pad_tokens keeps it, and then every eod label loses its loss."""
    shared = SimpleNamespace(vocab_size=VOCAB, eod=EOD, pad=EOD)
    item = make(corpus, tmp_path, tokenizer=shared)[0]
    assert item["loss_mask"].all() and (item["labels"] == EOD).any()
    with pytest.warns(UserWarning, match="pad id 0 is also its eod or bos"):
        gpt = make(corpus, tmp_path, tokenizer=shared, allow_ambiguous_pad_tokens=True)
    item = gpt[0]
    eod_labels = make(corpus, tmp_path)[0]["labels"] == EOD
    assert eod_labels.any() and torch.equal(item["loss_mask"], (~eod_labels).float())
    # A pad that is the bos is no pad either; one of its own masks its labels.
    fives = torch.stack([make(corpus, tmp_path)[i]["labels"] == 5 for i in range(8)])
    assert fives.any()
    for bos, masked in ((5, False), (None, True)):
        tokenizer = SimpleNamespace(vocab_size=VOCAB, eod=EOD, pad=5, bos=bos)
        gpt = make(corpus, tmp_path, tokenizer=tokenizer)
        loss = torch.stack([gpt[i]["loss_mask"] for i in range(8)])
        assert torch.equal(loss == 0, fives & masked)


def test_without_the_extra_token_the_last_label_is_masked(corpus, tmp_path):
    item = make(corpus, tmp_path, add_extra_token_to_sequence=False)[0]
    assert item["loss_mask"][-1] == 0 and item["labels"][-1] == 0


def digest(gpt: GPTDataset) -> str:
    h = hashlib.sha256()
    for a in (gpt.document_index, gpt.sample_index, gpt.shuffle_index):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_deterministic_across_builds_and_processes(corpus, tmp_path):
    first = digest(make(corpus, tmp_path / "a", 150))
    assert digest(make(corpus, tmp_path / "b", 150)) == first
    code = (
        "import sys, numpy as np; sys.path.insert(0, sys.argv[3]);"
        "from test_gpt_dataset import make, digest; from pathlib import Path;"
        "print(digest(make(sys.argv[1], Path(sys.argv[2]), 150)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, corpus, str(tmp_path / "c"), os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == first
    assert digest(make(corpus, tmp_path / "d", 150, random_seed=99)) != first


def test_cache_is_reused_and_keyed_by_the_settings(corpus, tmp_path, monkeypatch):
    built = make(corpus, tmp_path, 100)
    folder = tmp_path / "cache"
    assert len(list(folder.glob("*-description.txt"))) == 1

    def no_build(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    with monkeypatch.context() as m:
        m.setattr(gpt_module, "build_gpt_indices", no_build)
        again = make(corpus, tmp_path, 100)
    assert isinstance(again.sample_index, np.memmap)
    assert digest(again) == digest(built)
    make(corpus, tmp_path, 100, sequence_length=8)
    assert len(list(folder.glob("*-description.txt"))) == 2


def test_other_ranks_do_not_build_a_missing_cache(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(gpt_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(gpt_module.dist, "get_rank", lambda: 1)
    with pytest.raises(FileNotFoundError, match="index cache entry missing"):
        make(corpus, tmp_path, 100)


def test_samples_from_an_empty_split_are_an_error(corpus, tmp_path):
    expected = r"c_text_document \(train split\): 10 samples were asked of a split with no"
    with pytest.raises(ValueError, match=expected):
        make(corpus, tmp_path, 10, ids=np.zeros(0, np.int32))


def test_mock_dataset(tmp_path):
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=64, tokenizer=TOKENIZER, mock=True,
                           split="1", create_attention_mask=False)  # fmt: skip
    ids = np.arange(200, dtype=np.int32)
    mock = MockGPTDataset(None, None, ids, 500, Split.train, cfg)
    assert len(mock) >= 500
    low = mock.dataset
    n = int(low.sequence_lengths[5])
    assert low.get(5).tolist() == [(k + 1) % VOCAB for k in range(n - 1)] + [EOD]
    assert low.get(5, 1, 2).tolist() == low.get(5)[1:3].tolist()
    assert mock[7]["tokens"].shape == (64,)
    with pytest.raises(ValueError, match="mock=True"):
        MockGPTDataset(None, None, ids, 5, Split.train, config(tmp_path, blend=(["c"], None),
                                                               split="1"))  # fmt: skip


def test_mock_data_without_a_blend_builds_megatrons_three_splits():
    # megatron-core: no blend and no blend_per_split means mock data split "1,1,1"
    # (any split given is replaced), each split's documents being
    # arange(round(lo * N), round(hi * N)) of the 100,000 mock sequences.
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=64, tokenizer=TOKENIZER,
                           split="969,30,1", create_attention_mask=False)  # fmt: skip
    assert cfg.mock and cfg.split == "1,1,1"
    sizes = [40, 20, 10]
    built = BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, cfg).build()
    bounds = [(0, 33333), (33333, 66667), (66667, 100000)]  # 1/3 and 2/3 of 100,000, rounded
    for split, dataset, size, (lo, hi) in zip(Split, built, sizes, bounds, strict=True):
        assert isinstance(dataset, MockGPTDataset) and dataset.index_split is split
        np.testing.assert_array_equal(dataset.indices, np.arange(lo, hi, dtype=np.int32))
        direct = MockGPTDataset(None, None, np.arange(lo, hi, dtype=np.int32), size, split, cfg)
        assert len(dataset) == len(direct) >= size
        for i in (0, size - 1):
            assert torch.equal(dataset[i]["tokens"], direct[i]["tokens"])
