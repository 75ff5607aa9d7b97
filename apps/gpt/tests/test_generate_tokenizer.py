"""The tokenizer generation rebuilds from a checkpoint's saved data settings."""

import json

import torch

from mp_gpt.generate import _tokenizer_and_vocabulary


def checkpoint(folder, **data) -> str:
    """A checkpoint directory holding only what the tokenizer is read from."""
    folder.mkdir()
    (folder / "mp_metadata.json").write_text(json.dumps({"chunks": []}))
    saved = {
        "tokenizer_type": "NullTokenizer",
        "vocab_file": None,
        "merge_file": None,
        "tokenizer_model": None,
        "vocab_size": 1000,
        "make_vocab_size_divisible_by": 128,
    }
    torch.save({"config": {"data": saved | data}}, folder / "common.pt")
    return str(folder)


def test_a_null_tokenizer_is_rebuilt_with_the_ids_it_was_saved_with(tmp_path):
    saved = checkpoint(tmp_path / "now", null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1)
    tokenizer, padded = _tokenizer_and_vocabulary(saved, 1)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, padded) == (1000, 999, None, 1024)
    named = checkpoint(tmp_path / "named", null_tokenizer_eod_id=0, null_tokenizer_pad_id=5)
    tokenizer, _ = _tokenizer_and_vocabulary(named, 1)
    assert (tokenizer.eod, tokenizer.pad) == (0, 5)
    # Saved before NullTokenizer's eod became vocab_size - 1: its eod came after the ids.
    tokenizer, padded = _tokenizer_and_vocabulary(checkpoint(tmp_path / "before"), 1)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, padded) == (1001, 1000, None, 1024)
