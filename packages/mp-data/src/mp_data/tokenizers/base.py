"""What every tokenizer offers, and the part shared by those backed by Hugging Face's library.

A tokenizer turns text into token ids and back, and names the ids that
datasets need: `eod` (end of document, appended between documents and used
by the loss and attention masks), `pad` and `bos` (None when it has none).
`vocab_size` is the size before padding; the embedding table is padded with
`vocab_size_with_padding` (build.py).

`identity` is a string that changes whenever the ids for some text would: the
type, the special-tokens-as-text option when set, and a SHA-256 of the bytes
of every file that shapes tokenization. It
goes into dataset cache keys, so an index built for one vocabulary is never
reused for another (the same files at another path give the same identity).

Tokenization itself is never written here: `BackedTokenizer` hands text to a
`tokenizers.Tokenizer` (Rust), configured by each subclass.
"""

from __future__ import annotations

import hashlib
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import cached_property

import tokenizers

__all__ = [
    "BackedTokenizer",
    "Tokenizer",
    "check_ids",
    "digest",
    "positive_int",
    "read_file",
]


class Tokenizer(ABC):
    """Text <-> ids, with the special ids datasets use (Megatron's names)."""

    vocab_size: int
    """Ids run from 0 to vocab_size - 1 (before padding for the embedding table)."""

    eod: int | None
    """End of document: appended after each document and used by the masks."""

    pad: int | None = None
    """Padding id, or None when the vocabulary has none."""

    bos: int | None = None
    """Beginning of sequence, or None when the vocabulary has none."""

    identity: str
    """Type and a hash of the vocabulary files: changes whenever tokenization would."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids of `text`."""

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """The ids of each text; backed tokenizers encode them on Rust threads.

        Those threads are tokenizers' own: in a process forked after they
        started it falls back to one thread and warns, and a pool of worker
        processes should set TOKENIZERS_PARALLELISM=false before tokenizing.
        """
        return [self.tokenize(text) for text in texts]

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of `ids`; an id outside the vocabulary is a ValueError."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class BackedTokenizer(Tokenizer):
    """A tokenizer whose text -> ids work is done by `self.backend`.

    Subclasses build the backend, hand it to `_set_backend`, and set the
    attributes of `Tokenizer`. `add_special_tokens` says whether the
    backend's post-processor (a Llama tokenizer's leading <s>, BERT's [CLS]
    and [SEP]) adds its tokens.

    Special tokens (the backend's added tokens marked special) are matched in
    the text, as transformers does: "<|endoftext|>" in a GPT-2 document is
    the id of <|endoftext|>. `special_tokens_as_text` turns that off, so
    their text is tokenized like any other and no document can produce a
    special id (an end of document, a separator) by containing its text.
    """

    backend: tokenizers.Tokenizer
    add_special_tokens: bool = False
    special_tokens_as_text: bool = False

    def _set_backend(self, backend: tokenizers.Tokenizer, special_tokens_as_text: bool) -> None:
        backend.encode_special_tokens = special_tokens_as_text
        self.backend = backend
        self.special_tokens_as_text = special_tokens_as_text

    def _identity(self, name: str, contents: Iterable[tuple[str, bytes]]) -> str:
        """`name`, the option when set, and the digest of the files (see the module docstring)."""
        option = ":special-tokens-as-text" if self.special_tokens_as_text else ""
        return f"{name}{option}:sha256=" + digest(contents)

    def tokenize(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=self.add_special_tokens).ids

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[int]]:
        encodings = self.backend.encode_batch(
            list(texts), add_special_tokens=self.add_special_tokens
        )
        return [encoding.ids for encoding in encodings]

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token."""
        return {i: token for token, i in self.vocab.items()}

    def _decode_tokens(self, ids: Iterable[int]) -> str:
        # Megatron's own GPT-2 and BERT tokenizers detokenize this way: id ->
        # token through the vocabulary, then the tokens -> text.
        ids = check_ids(ids, self.vocab_size, type(self).__name__)
        return self.backend.decoder.decode([self.inv_vocab[i] for i in ids])


def check_ids(ids: Iterable[int], vocab_size: int, owner: str) -> list[int]:
    """`ids` as a list of ints, each one in 0 .. vocab_size - 1."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{owner}: id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    return ids


def positive_int(value, field: str, owner: str) -> int:
    """`value` as an int >= 1 (numpy integers welcome, bools and floats not)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{owner}: {field} must be an integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{owner}: {field} must be at least 1, got {number}")
    return number


def read_file(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of `path`; FileNotFoundError names the file and what it was for."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file ({what})")
    with open(path, "rb") as f:
        return f.read()


def digest(contents: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 of named byte strings, each name and length included so none can be confused."""
    h = hashlib.sha256()
    for name, data in contents:
        for part in (name.encode(), data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()
