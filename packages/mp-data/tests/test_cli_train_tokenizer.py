"""mp-data train-tokenizer: the files load as GPT2BPETokenizer and HuggingFaceTokenizer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from mp_data import IndexedDataset
from mp_data.cli import main
from mp_data.tokenizers import build_tokenizer

CORPUS = [
    f"The {animal} number {i} sat on the mat, then ran to the {place}. Ünïcode: café ☕ {i * 7}"
    for i in range(60)
    for animal, place in [("cat", "garden"), ("dog", "park"), ("bird", "tree")]
]


def train(tmp_path: Path, vocab_size: int = 400, **kwargs) -> Path:
    source = tmp_path / "corpus.jsonl.gz"
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(CORPUS))
    source.write_bytes(gzip.compress(lines.encode()))
    output = tmp_path / "tok"
    args = ["--input", str(source), "--vocab-size", str(vocab_size), "--output", str(output)]
    assert main(["train-tokenizer", *args]) == 0
    return output


def test_trained_files_load_and_round_trip(tmp_path, capsys):
    folder = train(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [
        "merges.txt",
        "tokenizer.json",
        "vocab.json",
    ]
    assert "trained on 180 documents" in capsys.readouterr().out
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=folder / "vocab.json", merge_file=folder / "merges.txt"
    )
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    assert gpt2.vocab_size == hf.vocab_size == 400
    assert gpt2.eod == hf.eod == 0  # <|endoftext|>, the one special token
    text = "The cat sat on the mat. An unseen word: zebra 🦓 naïve!"
    ids = gpt2.tokenize(text)
    assert hf.tokenize(text) == ids
    assert gpt2.detokenize(ids) == hf.detokenize(ids) == text
    assert len(gpt2.tokenize(CORPUS[0])) < len(CORPUS[0].encode()) / 2  # it did learn merges


def test_trained_tokenizer_preprocesses(tmp_path, capsys):
    folder = train(tmp_path)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:5]))
    args = ["--input", str(source), "--output-prefix", str(tmp_path / "out"), "--append-eod"]
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    assert main(["preprocess", *args, *hf]) == 0
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    assert [tokenizer.detokenize(s[:-1].tolist()) for s in dataset] == CORPUS[:5]
    assert all(s[-1] == 0 for s in dataset) and dataset.dtype == np.uint16


def test_train_tokenizer_errors(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    args = ["train-tokenizer", "--input", str(source), "--output", str(tmp_path / "t")]
    assert main([*args, "--vocab-size", "100"]) == 1
    assert "--vocab-size 100: must be at least 257" in capsys.readouterr().err
    assert main([*args, "--vocab-size", "300"]) == 1
    assert f"{source}:2: no key 'text'" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    assert main([*args, "--vocab-size", "300", "--skip-bad-lines"]) == 0
    assert "(1 bad lines skipped)" in capsys.readouterr().out
