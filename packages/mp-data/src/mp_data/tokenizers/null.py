"""Megatron's NullTokenizer: the text already is the ids, for benchmarks and debugging.

Text is whitespace-separated integers ("12 7 3"; Megatron splits on single
spaces only, so it rejects the tabs and double spaces accepted here), and
detokenize joins ids with single spaces. For a given vocab_size N the ids are
0 .. N-1 and eod is N-1 unless `eod_id` names another (megatron.core's rule,
--null-tokenizer-eod-id). There is no pad unless `pad_id` names one (-1, the
default, is none: --null-tokenizer-pad-id), and no bos.

Megatron's legacy tokenizer (megatron/training/tokenizer) added the eod after
the N ids instead, a vocabulary of N + 1: `--vocab-size N+1` gives its ids here.
An id outside 0 .. N-1, in text or as eod or pad, is an error; Megatron does not
check.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from mp_data.tokenizers.base import Tokenizer, check_ids, positive_int

__all__ = ["NullTokenizer"]

NO_PAD = -1
"""--null-tokenizer-pad-id's default: the vocabulary has no pad."""


class NullTokenizer(Tokenizer):
    """Ids written as text; eod is vocab_size - 1 unless `eod_id` names another id."""

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = NO_PAD) -> None:
        size = positive_int(vocab_size, "vocab_size", "NullTokenizer")
        self.vocab_size = size
        self.eod = size - 1 if eod_id is None else _id_in(eod_id, size, "eod_id")
        pad = _integer(pad_id, "pad_id")
        self.pad = None if pad == NO_PAD else _id_in(pad, size, "pad_id")
        shown_pad = NO_PAD if self.pad is None else self.pad
        self.identity = f"NullTokenizer:vocab_size={size}:eod={self.eod}:pad={shown_pad}"

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(
                    f"NullTokenizer: {word!r} is not an integer id (its text is ids "
                    "separated by whitespace)"
                ) from None
        # The eod itself may appear in text: data written by detokenize holds it.
        return check_ids(ids, self.vocab_size, "NullTokenizer")

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(i) for i in check_ids(ids, self.vocab_size, "NullTokenizer"))


def _integer(value, field: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"NullTokenizer: {field} must be an integer, got {value!r}") from None


def _id_in(value, size: int, field: str) -> int:
    number = _integer(value, field)
    if not 0 <= number < size:
        raise ValueError(
            f"NullTokenizer: {field}={number} is outside the vocabulary 0..{size - 1} "
            f"(vocab_size={size})"
        )
    return number
