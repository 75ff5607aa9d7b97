"""Split strings, split matrices and GPTDatasetConfig validation."""

from types import SimpleNamespace

import numpy as np
import pytest

from mp_data import (
    DataConfig,
    GPTDatasetConfig,
    Split,
    parse_and_normalize_split,
    split_indices,
    split_matrix,
)

TOKENIZER = SimpleNamespace(vocab_size=100, eod=0, pad=None)


def test_megatrons_default_split():
    weights = parse_and_normalize_split("969,30,1")
    assert weights == [0.969, 0.03, 0.001]
    matrix = split_matrix(weights)
    assert matrix[0] == (0.0, 0.969)
    assert matrix[1][0] == 0.969 and matrix[2][1] == pytest.approx(1.0)
    train, valid, test = split_indices(matrix, 1000)
    assert (train[0], train[-1], len(train)) == (0, 968, 969)
    assert (valid[0], len(valid), test.tolist()) == (969, 30, [999])
    assert train.dtype == np.int32


def test_zero_and_missing_parts_are_empty_splits():
    assert split_matrix(parse_and_normalize_split("99,1")) == [(0.0, 0.99), (0.99, 1.0), None]
    assert split_matrix(parse_and_normalize_split("1, 0, 1")) == [(0.0, 0.5), None, (0.5, 1.0)]
    assert [Split(i).name for i in range(3)] == ["train", "valid", "test"]


@pytest.mark.parametrize("bad", ["", "1,2,3,4", "0,0,0", "-1,2"])
def test_bad_split_strings(bad):
    with pytest.raises(ValueError, match=f"split={bad!r}"):
        parse_and_normalize_split(bad)


def test_config_derives_the_split_matrix():
    c = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["a"], None), split="1,1",
                         tokenizer=TOKENIZER)  # fmt: skip
    assert c.split_matrix == [(0.0, 0.5), (0.5, 1.0), None]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sequence_length=0), "sequence_length=0 must be >= 1"),
        (dict(blend=(["a"], None)), "split is required"),
        (dict(blend=(["a"], None), blend_per_split=[(["a"], None), None, None], split="1"),
         "exclusive"),
        (dict(blend_per_split=[(["a"], None), None]), "blend_per_split has 2 entries"),
        (dict(blend_per_split=[(["a"], None), None, None], split="1"), "meaningless"),
        (dict(blend=(["a", "b"], [1.0]), split="1"), r"blend: 1 weights for 2 datasets"),
        (dict(blend=(["a", "b"], [1.0, -2.0]), split="1"), r"weights must be >= 0, got \[-2.0\]"),
        (dict(blend=([], None), split="1"), "blend lists no dataset prefixes"),
        (dict(mock=True, split="1", tokenizer=None), "tokenizer is required"),
        (dict(mock=True, split="1", reset_attention_mask=True, create_attention_mask=False),
         "reset_attention_mask=True needs create_attention_mask=True"),
        (dict(mock=True, split="1", mid_level_dataset_surplus=-0.1),
         "mid_level_dataset_surplus=-0.1"),
    ],
)  # fmt: skip
def test_invalid_configs(kwargs, message):
    base = dict(random_seed=1, sequence_length=8, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match=message):
        GPTDatasetConfig(**(base | kwargs))


def test_every_public_name_resolves_and_import_stays_light():
    import subprocess
    import sys

    import mp_data

    assert sorted(mp_data.__all__) == sorted(mp_data._EXPORTS)
    for name in mp_data.__all__:
        assert getattr(mp_data, name) is not None, name
    # Importing the package (as the CLI does) must not import torch.
    code = "import sys, mp_data, mp_data.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_blend_from_a_megatron_command_line_list():
    from mp_data import get_blend_from_list

    assert get_blend_from_list(None) is None
    assert get_blend_from_list(["0.3", "web", "0.7", " code"]) == (["web", "code"], [0.3, 0.7])
    assert get_blend_from_list(["web", "code"]) == (["web", "code"], None)
    assert get_blend_from_list(["web", "code", "books"]) == (["web", "code", "books"], None)
    with pytest.raises(ValueError, match=r"entries \['web'\] stand where weights should"):
        get_blend_from_list(["1", "books", "web", "code"])
    with pytest.raises(ValueError, match=r"weights must be >= 0, got \[-1.0\]"):
        get_blend_from_list(["-1", "web", "2", "code"])
    with pytest.raises(ValueError, match="the blend list is empty"):
        get_blend_from_list([])


def test_data_config_attention_mask_rules():
    assert not DataConfig().batches_carry_documents  # causal attention needs no mask
    assert DataConfig(reset_attention_mask=True).batches_carry_documents
    with pytest.raises(ValueError, match="reset_attention_mask=True needs "
                                         "create_attention_mask_in_dataloader=True"):  # fmt: skip
        DataConfig(reset_attention_mask=True, create_attention_mask_in_dataloader=False)


def test_data_config_null_tokenizer_ids():
    assert DataConfig(vocab_size=10, null_tokenizer_eod_id=0, null_tokenizer_pad_id=9)
    assert DataConfig(tokenizer_type="NullTokenizer", vocab_size=10, null_tokenizer_eod_id=0)
    refused = "null_tokenizer_eod_id=0 set NullTokenizer's ids; tokenizer_type=GPT2BPETokenizer"
    with pytest.raises(ValueError, match=refused):
        DataConfig(tokenizer_type="GPT2BPETokenizer", null_tokenizer_eod_id=0)
    with pytest.raises(ValueError, match="null_tokenizer_pad_id=-2 must be an id, or -1"):
        DataConfig(vocab_size=10, null_tokenizer_pad_id=-2)


def test_data_config_vocabulary_padding_and_blend_surplus():
    assert DataConfig(pad_vocab_size=False, padded_vocab_size=96).padded_vocab_size == 96
    with pytest.raises(ValueError, match="pad_vocab_size=False leaves the embedding's rows "
                                         "unknown: give padded_vocab_size"):  # fmt: skip
        DataConfig(pad_vocab_size=False)
    assert DataConfig(mid_level_dataset_surplus=0.05).mid_level_dataset_surplus == 0.05
    with pytest.raises(ValueError, match=r"mid_level_dataset_surplus=-0\.1 must be >= 0"):
        DataConfig(mid_level_dataset_surplus=-0.1)
