"""Megatron's NullTokenizer: the text already is the ids, for benchmarks and debugging.

Text is whitespace-separated integers ("12 7 3"; Megatron splits on single
spaces only, so it rejects the tabs and double spaces accepted here), and
detokenize joins ids with single spaces. For a given vocab_size N, the ids
of the vocabulary are 0 .. N-1 and eod is N, the one id after them, so
vocab_size reports N + 1 (Megatron's rule: the model's embedding must hold
the eod). An id outside 0 .. N is an error here; Megatron does not check.
There is no vocabulary to look up, no pad and no bos.
"""

from __future__ import annotations

from collections.abc import Iterable

from mp_data.tokenizers.base import Tokenizer, check_ids, positive_int

__all__ = ["NullTokenizer"]


class NullTokenizer(Tokenizer):
    """Ids written as text; eod is `vocab_size` (the argument), one past the text's ids."""

    def __init__(self, vocab_size: int) -> None:
        size = positive_int(vocab_size, "vocab_size", "NullTokenizer")
        self.eod = size
        self.vocab_size = size + 1
        self.identity = f"NullTokenizer:vocab_size={size}"

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
