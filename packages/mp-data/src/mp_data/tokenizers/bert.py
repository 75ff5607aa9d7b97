"""BERT's WordPiece, from a vocab.txt, with the ids of megatron-core 0.19's BERT tokenizers.

megatron-core 0.19 builds BertWordPieceLowerCase and BertWordPieceCase as
transformers' BERT tokenizer over the given vocab.txt (with the settings of
bert-large-uncased and bert-large-cased: lower case or not), and encodes with
its ordinary call. Here tokenizers' pieces do the same steps: clean the text
(drop control characters, map whitespace to spaces), put spaces around CJK
ideographs, lowercase and strip accents (lower case only), split on
whitespace and punctuation, then greedy longest-match WordPiece with "##"
continuations, [UNK] for a word with no match or longer than 100 characters.

What that means for the ids (each checked against megatron-core 0.19.2, see
docs/data.md):

- every encoded text is wrapped in [CLS] ... [SEP]: "" gives [CLS] [SEP],
  and with --split-sentences every sentence gets its own pair;
- the special tokens [PAD], [UNK], [CLS], [SEP], [MASK] are matched in the
  text as written ("a [SEP] b" has the id of [SEP]; "[sep]" is text), unless
  `special_tokens_as_text` (then their text is ordinary text);
- eod = eos = sep = the id of [SEP], bos = cls = the id of [CLS], pad = the
  id of [PAD], mask = the id of [MASK];
- BertWordPieceCase adds 100 special tokens <extra_id_0> ... <extra_id_99>
  after the file's entries (megatron-core's T5-style sentinels), so its
  vocab_size is the file's size + 100; BertWordPieceLowerCase adds nothing
  (bert-base-uncased: 30522).

The tokenizer Megatron used before megatron.core.tokenizers (--legacy-
tokenizer) added neither [CLS] nor [SEP], allowed words of 200 characters,
and appended [BOS] and [EOS] to the vocabulary as bos and eod; files it wrote
differ from these.

Detokenizing uses tokenizers' WordPiece decoder, whose clean-up of spaces
before punctuation is applied token by token: "it ' s" stays as it is.
"""

from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from mp_data.tokenizers.base import BackedTokenizer, read_file

__all__ = ["BertWordPieceCase", "BertWordPieceLowerCase", "BertWordPieceTokenizer"]

REQUIRED = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""BERT's special tokens, in the order transformers registers them; all must be in the file."""
EXTRA_IDS = tuple(f"<extra_id_{i}>" for i in range(100))
"""Special tokens megatron-core 0.19 adds to BertWordPieceCase (and not to the lower-case one)."""
MAX_WORD_CHARS = 100
"""Longer words become [UNK] (transformers' BERT tokenizer's limit)."""


class BertWordPieceTokenizer(BackedTokenizer):
    """Megatron's BERT WordPiece tokenizer; `lower_case` picks the uncased pipeline."""

    def __init__(
        self,
        vocab_file: str | os.PathLike,
        lower_case: bool,
        extra_ids: tuple[str, ...] = (),
        special_tokens_as_text: bool = False,
    ) -> None:
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
        # Matched in the text before normalization, so "[SEP]" is the token
        # and a lower-cased "[sep]" is not; new ones (the extra ids) get the
        # ids after the file's.
        backend.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in REQUIRED + extra_ids]
        )
        cls, sep = file_vocab["[CLS]"], file_vocab["[SEP]"]
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        self._set_backend(backend, special_tokens_as_text)
        self.add_special_tokens = True
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.cls, self.sep = cls, sep
        self.pad, self.mask = file_vocab["[PAD]"], file_vocab["[MASK]"]
        self.bos = self.cls
        self.eos = self.eod = self.sep
        self.identity = self._identity(name, [("vocab.txt", data)])

    def detokenize(self, ids) -> str:
        return self._decode_tokens(ids)


class BertWordPieceLowerCase(BertWordPieceTokenizer):
    """Megatron's BertWordPieceLowerCase: lowercases and strips accents first."""

    def __init__(self, vocab_file: str | os.PathLike, special_tokens_as_text: bool = False) -> None:
        super().__init__(vocab_file, True, special_tokens_as_text=special_tokens_as_text)


class BertWordPieceCase(BertWordPieceTokenizer):
    """Megatron's BertWordPieceCase: keeps case and accents; adds the 100 extra ids."""

    def __init__(self, vocab_file: str | os.PathLike, special_tokens_as_text: bool = False) -> None:
        super().__init__(vocab_file, False, EXTRA_IDS, special_tokens_as_text)


def _read_vocab(path: str, data: bytes) -> dict[str, int]:
    # One token a line, its id the line number, trailing whitespace trimmed:
    # tokenizers' WordPiece.read_file, which transformers' BERT tokenizer uses
    # (a lone \r is no line end there). A repeated token would leave a hole in
    # the ids, so it is an error here.
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e})") from e
    vocab = models.WordPiece.read_file(path)
    if not vocab:
        raise ValueError(f"{path}: empty vocabulary")
    taken = set(vocab.values())
    hole = next((i for i in range(max(taken) + 1) if i not in taken), None)
    if hole is not None:
        token = data.decode("utf-8").split("\n")[hole].rstrip()
        raise ValueError(f"{path}:{vocab[token] + 1}: token {token!r} repeats line {hole + 1}")
    return vocab
