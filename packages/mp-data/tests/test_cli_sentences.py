"""mp-data preprocess --split-sentences and --keep-newlines (Punkt, as Megatron)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mp_data import IndexedDataset
from mp_data.cli import main, sentences
from mp_data.cli.sentences import SentenceSplitter
from mp_data.tokenizers import build_tokenizer

GPT2 = Path(__file__).parent / "assets" / "tokenizers" / "gpt2"
GPT2_ARGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(GPT2 / "vocab.json"),
    "--merge-file", str(GPT2 / "merges.txt"),
]  # fmt: skip

DOCUMENTS = [
    "Mr. Smith went to Washington. He arrived on Jan. 5th! The next day was rainy.",
    "First line of a poem.\nSecond line.\n\nA new stanza starts here. It ends here.",
    "One sentence without a final period",
    "",
]


def split_dataset(tmp_path: Path, *extra: str) -> tuple[IndexedDataset, list[list[str]]]:
    """Preprocesses DOCUMENTS; returns the dataset and each document's decoded sentences."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    prefix = tmp_path / "out"
    args = ["preprocess", "--input", str(source), "--output-prefix", str(prefix)]
    assert main([*args, *GPT2_ARGS, "--split-sentences", *extra]) == 0
    assert not Path(f"{prefix}_text_document.bin").exists()
    dataset = IndexedDataset(f"{prefix}_text_sentence")
    tokenizer = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=GPT2 / "vocab.json", merge_file=GPT2 / "merges.txt"
    )
    bounds = dataset.document_indices
    decoded = [
        [tokenizer.detokenize(dataset[i].tolist()) for i in range(bounds[d], bounds[d + 1])]
        for d in range(dataset.document_count)
    ]
    return dataset, decoded


def test_sentence_level_files_concatenate_back_to_the_documents(tmp_path):
    dataset, decoded = split_dataset(tmp_path)
    assert dataset.document_count == len(DOCUMENTS)
    assert decoded[0] == [
        "Mr. Smith went to Washington.",  # "Mr." is a known abbreviation
        "He arrived on Jan. 5th!",
        "The next day was rainy.",
    ]
    # Punkt drops the whitespace between sentences, newlines included.
    assert decoded[1] == [
        "First line of a poem.",
        "Second line.",
        "A new stanza starts here.",
        "It ends here.",
    ]
    assert decoded[2] == [DOCUMENTS[2]] and decoded[3] == []
    assert " ".join(decoded[0]) == DOCUMENTS[0]
    assert len(dataset) == sum(map(len, decoded))


def test_keep_newlines_keeps_the_whitespace_after_each_sentence(tmp_path):
    _, decoded = split_dataset(tmp_path, "--keep-newlines")
    assert decoded[1] == [
        "First line of a poem.\n",
        "Second line.\n\n",
        "A new stanza starts here. ",
        "It ends here.",
    ]
    for document, sentences_of_it in zip(DOCUMENTS, decoded, strict=True):
        assert "".join(sentences_of_it) == document


def test_keep_newlines_realigns_closing_punctuation_as_nltk_does():
    split = SentenceSplitter("english", keep_newlines=True).split
    # NLTK moves a closing quote or bracket back onto its sentence and drops the
    # whitespace after it, even with Megatron's --keep-newlines regex.
    assert split('He said "Go."\n\nThen he left.  ') == ['He said "Go."', "Then he left."]
    assert split("Notes (Issue 7.)  The next one.\nLast.") == [
        "Notes (Issue 7.)",
        "The next one.\n",
        "Last.",
    ]
    assert split("   ") == [] and split(" Hi. ") == [" Hi."]


def test_append_eod_goes_on_the_last_sentence(tmp_path):
    dataset, _ = split_dataset(tmp_path, "--append-eod")
    bounds = dataset.document_indices
    for d in range(3):
        last = dataset[int(bounds[d + 1]) - 1]
        assert last[-1] == 50256
        assert 50256 not in np.concatenate(
            [dataset[i] for i in range(bounds[d], bounds[d + 1] - 1)] or [np.zeros(0)]
        )


def test_texts_are_split_a_megatron_piece_at_a_time(monkeypatch):
    monkeypatch.setattr(sentences, "MAX_CHARS", 30)
    text = "The first sentence is long. The second one too."
    split = SentenceSplitter("english").split(text)
    # The 30-character pieces are split on their own, as in Megatron's Encoder.split.
    assert split == ["The first sentence is long.", "Th", "e second one too."]


def test_unknown_language_is_an_error(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "Hi."}\n')
    args = ["preprocess", "--input", str(source), "--output-prefix", str(tmp_path / "o")]
    assert main([*args, *GPT2_ARGS, "--split-sentences", "--lang", "klingon"]) == 1
    err = capsys.readouterr().err
    assert "--lang 'klingon'" in err and "english" in err
