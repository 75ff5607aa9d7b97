"""A tokenizer from Megatron's --tokenizer-type and file arguments, and the padded vocabulary size.

`build_tokenizer` takes Megatron's type names and argument names
(--vocab-file, --merge-file, --tokenizer-model, --vocab-size,
--null-tokenizer-eod-id, --null-tokenizer-pad-id), so a Megatron command line or
YAML maps over; each type reads only the arguments it needs.

`vocab_size_with_padding` is Megatron's _vocab_size_with_padding: the
embedding table is rounded up to a multiple of make_vocab_size_divisible_by
times the tensor-parallel size, so every TP rank holds an equal slice of a
GPU-friendly width (GPT-2's 50257 -> 50304 at TP=1). The extra rows are ids no
text produces.
"""

from __future__ import annotations

import os

from mp_data.tokenizers.base import Tokenizer, positive_int
from mp_data.tokenizers.bert import BertWordPieceCase, BertWordPieceLowerCase
from mp_data.tokenizers.gpt2 import GPT2BPETokenizer
from mp_data.tokenizers.huggingface import HuggingFaceTokenizer
from mp_data.tokenizers.null import NO_PAD, NullTokenizer

__all__ = ["TOKENIZER_TYPES", "build_tokenizer", "vocab_size_with_padding"]

TOKENIZER_TYPES = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
"""Megatron's tokenizer types that mp provides -> the arguments each one requires."""


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    special_tokens_as_text: bool = False,
    sft_tokenizer_prompt_format: str = "nemotron-h-aligned",
    null_tokenizer_eod_id: int | None = None,
    null_tokenizer_pad_id: int = NO_PAD,
) -> Tokenizer:
    """The tokenizer of `tokenizer_type`, built from the arguments it requires.

    `special_tokens_as_text` tokenizes the text of special tokens as ordinary
    text instead of matching it (base.py); NullTokenizer has no special text.
    "SFTTokenizer" (Megatron's, for --sft) is a HuggingFaceTokenizer that also renders
    conversations in `sft_tokenizer_prompt_format` (mp_data.sft_tokenizer; it needs
    transformers). NullTokenizer's eod is vocab_size - 1 unless `null_tokenizer_eod_id`
    names another, and it has a pad only when `null_tokenizer_pad_id` is not -1.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"tokenizer_type {tokenizer_type!r} is not supported; choose one of "
            f"{', '.join(TOKENIZER_TYPES)} (a SentencePiece or tiktoken model saved as a "
            "Hugging Face tokenizer.json works as HuggingFaceTokenizer)"
        )
    given = {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
    }
    null_ids = null_tokenizer_eod_id is not None or null_tokenizer_pad_id != NO_PAD
    if null_ids and tokenizer_type != "NullTokenizer":
        raise ValueError(
            f"null_tokenizer_eod_id and null_tokenizer_pad_id are NullTokenizer's ids; "
            f"tokenizer_type {tokenizer_type!r} has its own"
        )
    missing = [name for name in TOKENIZER_TYPES[tokenizer_type] if given[name] is None]
    if missing:
        raise ValueError(f"tokenizer_type {tokenizer_type!r} requires {' and '.join(missing)}")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file, special_tokens_as_text)
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceLowerCase(vocab_file, special_tokens_as_text)
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceCase(vocab_file, special_tokens_as_text)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, special_tokens_as_text)
    if tokenizer_type == "SFTTokenizer":
        # Imported here: mp_data.sft_tokenizer builds on this package's HuggingFaceTokenizer.
        from mp_data.sft_tokenizer import SFTTokenizer

        return SFTTokenizer(tokenizer_model, sft_tokenizer_prompt_format)
    return NullTokenizer(vocab_size, null_tokenizer_eod_id, null_tokenizer_pad_id)


def vocab_size_with_padding(
    orig_vocab_size: int,
    make_vocab_size_divisible_by: int = 128,
    tensor_model_parallel_size: int = 1,
) -> int:
    """`orig_vocab_size` rounded up to a multiple of make_vocab_size_divisible_by * TP size."""
    size = positive_int(orig_vocab_size, "orig_vocab_size", "vocab_size_with_padding")
    divisor = positive_int(
        make_vocab_size_divisible_by, "make_vocab_size_divisible_by", "vocab_size_with_padding"
    )
    tp = positive_int(
        tensor_model_parallel_size, "tensor_model_parallel_size", "vocab_size_with_padding"
    )
    multiple = divisor * tp
    return -(-size // multiple) * multiple
