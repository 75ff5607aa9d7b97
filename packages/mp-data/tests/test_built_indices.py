"""Index arrays built in memory (mock data, no cache folder) are kept for the process:
the same settings take the arrays already built, read-only; counts within one epoch
share them, other settings build anew, and the least recently used entry goes first."""

from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

import mp_data.built_indices as built_indices
import mp_data.gpt_dataset as gpt_module
from mp_data import GPTDatasetConfig, MockGPTDataset, Split
from mp_data.gpt_indices import build_gpt_indices

TOKENIZER = SimpleNamespace(vocab_size=100, eod=0, pad=1)
IDS = np.arange(200, dtype=np.int32)  # about 6,400 samples of 64 tokens: one epoch


@pytest.fixture
def builds(monkeypatch) -> list[tuple]:
    """An empty memory for the test, and the arguments of every build made."""
    monkeypatch.setattr(built_indices, "_built", OrderedDict())
    made = []

    def counted(*args, **kwargs):
        made.append(args[2:])
        return build_gpt_indices(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "build_gpt_indices", counted)
    return made


def mock(num_samples, seed=1, ids=IDS, split=Split.train) -> MockGPTDataset:
    config = GPTDatasetConfig(random_seed=seed, sequence_length=64, tokenizer=TOKENIZER,
                              mock=True, split="1", create_attention_mask=False)  # fmt: skip
    return MockGPTDataset(None, None, ids, num_samples, split, config)


def test_counts_within_an_epoch_share_the_arrays_built(builds):
    first, second = mock(10), mock(3000)
    assert len(builds) == 1
    assert second.shuffle_index is first.shuffle_index
    assert second.sample_index is first.sample_index
    want = build_gpt_indices(first.dataset.sequence_lengths, IDS, 10, 64, 1)
    for name in ("document_index", "sample_index", "shuffle_index"):
        array = getattr(second, name)
        np.testing.assert_array_equal(array, getattr(want, name))
        assert not array.flags.writeable, name
    # the samples are those of a dataset built on its own
    alone = mock(10)
    assert [alone[i]["tokens"].tolist() for i in range(5)] == [
        first[i]["tokens"].tolist() for i in range(5)
    ]


def test_other_settings_build_anew(builds):
    one_epoch = mock(10)
    two_epochs = mock(len(one_epoch) + 5)  # a second epoch, shuffled apart
    other_seed = mock(10, seed=2)
    other_split = mock(10, split=Split.valid)
    assert len(builds) == 4
    assert len(two_epochs) > len(one_epoch)
    assert not np.array_equal(other_seed.shuffle_index, one_epoch.shuffle_index)
    np.testing.assert_array_equal(other_split.shuffle_index, one_epoch.shuffle_index)


def test_the_least_recently_used_entry_goes_first(builds):
    for seed in range(built_indices.INDICES_KEPT):
        mock(10, seed=seed)
    mock(10, seed=0)  # used again: now the most recent
    mock(10, seed=built_indices.INDICES_KEPT)  # one more: seed 1 goes
    assert len(builds) == built_indices.INDICES_KEPT + 1
    mock(10, seed=0)
    assert len(builds) == built_indices.INDICES_KEPT + 1
    mock(10, seed=1)
    assert len(builds) == built_indices.INDICES_KEPT + 2


def test_an_empty_split_still_names_the_dataset(builds):
    expected = r"MockGPTLowLevelDataset \(train split\): 10 samples were asked of a split"
    with pytest.raises(ValueError, match=expected):
        mock(10, ids=np.zeros(0, np.int32))
