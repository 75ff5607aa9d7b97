"""BERT's WordPiece, from a vocab.txt, with the ids of Megatron's BERT tokenizers.

The pipeline is Google's original BERT tokenizer, which Megatron ships as
bert_tokenization.FullTokenizer: clean the text (drop control characters,
map whitespace to spaces), put spaces around CJK ideographs, lowercase and
strip accents (lower-case vocabularies only), split on whitespace and
punctuation, then greedy longest-match WordPiece with "##" continuations,
[UNK] for a word with no match or longer than 200 characters. Tokenizers'
BertNormalizer, BertPreTokenizer and WordPiece model do each step; the
200-character limit is set explicitly (the library's default is 100).

Special ids follow Megatron's _BertWordPieceTokenizer (megatron/training/
tokenizer/tokenizer.py, the --legacy-tokenizer path that wrote most existing
.bin files):

- cls, sep, pad, mask are the ids of [CLS], [SEP], [PAD], [MASK] in the file;
- [BOS] and [EOS] are appended to the vocabulary when the file lacks them
  (bert-base-uncased: 30522 and 30523, so vocab_size is 30524); bos is [BOS],
  and eos = eod = [EOS].

Megatron-core's newer tokenizer system (megatron.core.tokenizers, through
transformers) differs: it appends nothing, uses [SEP] as eod and [CLS] as
bos, and adds 100 <extra_id_N> tokens for BertWordPieceCase. Ordinary text
gets the same ids either way, and 30522 and 30524 pad to the same embedding
size (30592 with vocab_size_with_padding's defaults).

As in Google's tokenizer, "[SEP]" inside text is text ("[", "sep", "]"): no
special token is matched in the input (transformers would match it).
Detokenizing uses tokenizers' WordPiece decoder, whose clean-up of spaces
before punctuation is applied token by token: "it ' s" stays as it is, where
Megatron's, applied to the joined string, gives "it's".
"""

from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from mp_data.tokenizers.base import BackedTokenizer, digest, read_file

__all__ = ["BertWordPieceCase", "BertWordPieceLowerCase", "BertWordPieceTokenizer"]

REQUIRED = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
APPENDED = ("[BOS]", "[EOS]")
MAX_WORD_CHARS = 200
"""Longer words become [UNK] (bert_tokenization.WordpieceTokenizer's limit)."""


class BertWordPieceTokenizer(BackedTokenizer):
    """Megatron's BERT WordPiece tokenizer; `lower_case` picks the uncased pipeline."""

    def __init__(self, vocab_file: str | os.PathLike, lower_case: bool) -> None:
        self.vocab_file, self.lower_case = os.fspath(vocab_file), lower_case
        name = type(self).__name__
        data = read_file(self.vocab_file, f"vocab_file of {name}")
        file_vocab = _read_vocab(self.vocab_file, data)
        missing = [t for t in REQUIRED if t not in file_vocab]
        if missing:
            raise ValueError(f"{self.vocab_file}: no {', '.join(missing)} in the vocabulary")
        backend = tokenizers.Tokenizer(
            models.WordPiece(file_vocab, unk_token="[UNK]", max_input_chars_per_word=MAX_WORD_CHARS)
        )
        backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case,
            lowercase=lower_case,
        )  # fmt: skip
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        self.backend = backend
        # [BOS] and [EOS] live only in our vocabulary, never in the backend's:
        # text can never produce them, as in Megatron, but they detokenize.
        vocab = dict(file_vocab)
        for token in APPENDED:
            vocab.setdefault(token, len(vocab))
        self.vocab = vocab
        self.vocab_size = len(vocab)
        self.cls, self.sep = vocab["[CLS]"], vocab["[SEP]"]
        self.pad, self.mask = vocab["[PAD]"], vocab["[MASK]"]
        self.bos, self.eos = vocab["[BOS]"], vocab["[EOS]"]
        self.eod = self.eos
        self.identity = f"{name}:sha256=" + digest([("vocab.txt", data)])

    def detokenize(self, ids) -> str:
        return self._decode_tokens(ids)


class BertWordPieceLowerCase(BertWordPieceTokenizer):
    """Megatron's BertWordPieceLowerCase: lowercases and strips accents first."""

    def __init__(self, vocab_file: str | os.PathLike) -> None:
        super().__init__(vocab_file, lower_case=True)


class BertWordPieceCase(BertWordPieceTokenizer):
    """Megatron's BertWordPieceCase: keeps case and accents."""

    def __init__(self, vocab_file: str | os.PathLike) -> None:
        super().__init__(vocab_file, lower_case=False)


def _read_vocab(path: str, data: bytes) -> dict[str, int]:
    # One token a line, its id the line number, each line stripped: Megatron's
    # bert_tokenization.load_vocab. A repeated token would leave a hole in the
    # ids and give [BOS] an id already taken, so it is an error here.
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e})") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for i, line in enumerate(lines):
        token = line.strip()
        if token in vocab:
            raise ValueError(f"{path}:{i + 1}: token {token!r} repeats line {vocab[token] + 1}")
        vocab[token] = i
    if not vocab:
        raise ValueError(f"{path}: empty vocabulary")
    return vocab
