"""mp-data preprocess on a mixed corpus, against megatron-core 0.19's preprocess_data.py rules.

The corpus (assets/corpus/mixed.jsonl) holds special-token text, an empty
document, a whitespace-only one, blank lines, indented lists, lone-period
lines, non-ASCII text and a word over 100 characters. The expected token
arrays are built here from the rules, not by the command under test:

- GPT-2: the text is cut at each "<|endoftext|>" written in it, which is the
  id 50256; the pieces in between are plain byte-level BPE;
- BERT lower case: the same cut at [PAD] [UNK] [CLS] [SEP] [MASK], then
  [CLS] ... [SEP] around every encoded piece (a document, or a sentence);
- sentences with no token are dropped; --append-eod adds the eod (50256, or
  [SEP] = 102 for BERT) to the last sequence of a document with any token.

The sentences are those Megatron's splitter wrote for this corpus (its "_ss"
files, as assets/corpus/megatron/sentences.jsonl and
sentences_keep_newlines.jsonl), and the .bin/.idx files Megatron wrote are
there too: the outputs must equal them byte for byte.
docs/data.md records the commands that produced them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mp_data import IndexedDataset
from mp_data.cli import main
from mp_data.cli.sentences import SentenceSplitter
from mp_data.tokenizers import BertWordPieceLowerCase, GPT2BPETokenizer

ASSETS = Path(__file__).parent / "assets"
CORPUS = ASSETS / "corpus" / "mixed.jsonl"
MEGATRON = ASSETS / "corpus" / "megatron"
GPT2 = ASSETS / "tokenizers" / "gpt2"
BERT_VOCAB = ASSETS / "tokenizers" / "bert-uncased" / "vocab.txt"

GPT2_ARGS = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(GPT2 / "vocab.json"),
             "--merge-file", str(GPT2 / "merges.txt"), "--append-eod"]  # fmt: skip
BERT_ARGS = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(BERT_VOCAB)]
RUNS = {  # name -> (options, level); Megatron's outputs are MEGATRON/{name}.bin/.idx
    "gpt2_doc": (GPT2_ARGS, "document"),
    "gpt2_sent": ([*GPT2_ARGS, "--split-sentences"], "sentence"),
    "gpt2_sent_nl": ([*GPT2_ARGS, "--split-sentences", "--keep-newlines"], "sentence"),
    "bert_doc": (BERT_ARGS, "document"),
    "bert_sent": ([*BERT_ARGS, "--split-sentences", "--append-eod"], "sentence"),
}

DOCUMENTS = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]


def megatron_sentences(name: str) -> list[list[str]]:
    lines = (MEGATRON / name).read_text("utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def plain_bpe() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(GPT2 / "vocab.json", GPT2 / "merges.txt", special_tokens_as_text=True)


@pytest.fixture(scope="module")
def plain_wordpiece() -> BertWordPieceLowerCase:
    return BertWordPieceLowerCase(BERT_VOCAB, special_tokens_as_text=True)


def cut_at(text: str, special: dict[str, int], encode) -> list[int]:
    """encode() of the text between the special tokens written in it, their ids in between."""
    parts = re.split("(" + "|".join(map(re.escape, special)) + ")", text)
    ids: list[int] = []
    for i, part in enumerate(parts):
        ids += [special[part]] if i % 2 else encode(part) if part else []
    return ids


def gpt2_ids(text: str, plain_bpe) -> list[int]:
    return cut_at(text, {"<|endoftext|>": 50256}, plain_bpe.tokenize)


def bert_ids(text: str, plain_wordpiece) -> list[int]:
    special = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    # plain_wordpiece wraps each call in [CLS] ... [SEP]; the rule wants the bare ids.
    inner = cut_at(text, special, lambda part: plain_wordpiece.tokenize(part)[1:-1])
    return [101, *inner, 102]


def expected_documents(pieces: list[list[str]], encode, eod: int | None) -> list[list[list[int]]]:
    """Per document, its sequences: each piece encoded, empty ones dropped, eod on the last."""
    documents = []
    for document in pieces:
        sequences = [ids for ids in map(encode, document) if ids]
        if sequences and eod is not None:
            sequences[-1] = [*sequences[-1], eod]
        documents.append(sequences)
    return documents


def preprocess(tmp_path: Path, name: str) -> IndexedDataset:
    options, level = RUNS[name]
    prefix = tmp_path / name
    assert main(["preprocess", "--input", str(CORPUS), "--output-prefix", str(prefix),
                 *options]) == 0  # fmt: skip
    return IndexedDataset(f"{prefix}_text_{level}")


def written_documents(dataset: IndexedDataset) -> list[list[list[int]]]:
    bounds = dataset.document_indices
    return [
        [dataset[i].tolist() for i in range(bounds[d], bounds[d + 1])]
        for d in range(dataset.document_count)
    ]


def test_the_corpus_holds_the_hard_cases():
    assert "" in DOCUMENTS and "   \n  " in DOCUMENTS and "<|endoftext|>" in DOCUMENTS
    assert any("<|endoftext|>" in d and d != "<|endoftext|>" for d in DOCUMENTS)
    assert any("[SEP]" in d for d in DOCUMENTS)
    assert any("\n\n\n" in d for d in DOCUMENTS) and any("\n  - " in d for d in DOCUMENTS)
    assert any("\n.\n" in d for d in DOCUMENTS) and any(not d.isascii() for d in DOCUMENTS)
    assert any(len(word) > 100 for d in DOCUMENTS for word in d.split())


def test_gpt2_documents(tmp_path, capsys, plain_bpe):
    written = written_documents(preprocess(tmp_path, "gpt2_doc"))
    expected = expected_documents([[d] for d in DOCUMENTS], lambda t: gpt2_ids(t, plain_bpe), 50256)
    assert written == expected
    # The special-token text is an end of document where it sits, and the
    # empty document is a document with no sequence.
    assert written[DOCUMENTS.index("<|endoftext|>")] == [[50256, 50256]]
    assert written[DOCUMENTS.index("")] == []
    assert 50256 in written[1][0][:-1]


def test_gpt2_special_tokens_as_text(tmp_path, capsys, plain_bpe):
    prefix = tmp_path / "plain"
    assert main(["preprocess", "--input", str(CORPUS), "--output-prefix", str(prefix),
                 *GPT2_ARGS, "--special-tokens-as-text"]) == 0  # fmt: skip
    written = written_documents(IndexedDataset(f"{prefix}_text_document"))
    expected = expected_documents([[d] for d in DOCUMENTS], plain_bpe.tokenize, 50256)
    assert written == expected
    assert all(50256 not in seq[:-1] for doc in written for seq in doc)


@pytest.mark.parametrize(("name", "keep_newlines"), [("gpt2_sent", False), ("gpt2_sent_nl", True)])
def test_gpt2_sentences(tmp_path, capsys, plain_bpe, name, keep_newlines):
    sentences = megatron_sentences("sentences_keep_newlines.jsonl" if keep_newlines
                                   else "sentences.jsonl")  # fmt: skip
    splitter = SentenceSplitter("english", keep_newlines=keep_newlines)
    assert [splitter.split(d) for d in DOCUMENTS] == sentences
    written = written_documents(preprocess(tmp_path, name))
    assert written == expected_documents(sentences, lambda t: gpt2_ids(t, plain_bpe), 50256)


def test_bert_documents_and_sentences(tmp_path, capsys, plain_wordpiece):
    def encode(text):
        return bert_ids(text, plain_wordpiece)

    written = written_documents(preprocess(tmp_path, "bert_doc"))
    assert written == expected_documents([[d] for d in DOCUMENTS], encode, None)
    # Every document is one sequence, the empty one [CLS] [SEP].
    assert written[DOCUMENTS.index("")] == [[101, 102]]
    sentences = megatron_sentences("sentences.jsonl")
    written = written_documents(preprocess(tmp_path, "bert_sent"))
    assert written == expected_documents(sentences, encode, 102)
    assert written[DOCUMENTS.index("")] == []  # no sentence, so no sequence


@pytest.mark.parametrize("name", RUNS)
def test_files_equal_megatrons_byte_for_byte(tmp_path, capsys, name):
    dataset = preprocess(tmp_path, name)
    for suffix in (".bin", ".idx"):
        ours = Path(dataset.path_prefix + suffix).read_bytes()
        assert ours == (MEGATRON / f"{name}{suffix}").read_bytes(), suffix
