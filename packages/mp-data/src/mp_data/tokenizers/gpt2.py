"""GPT-2's byte-level BPE, from its vocab.json and merges.txt, with Megatron's ids.

The pipeline is the original GPT-2 encoder's: GPT-2's regular expression
splits the text into words (contractions, letters, digits, other symbols,
whitespace runs), each word's UTF-8 bytes are mapped to printable characters,
and the merges are applied by rank. Tokenizers' BPE model with the ByteLevel
pre-tokenizer (add_prefix_space=False, GPT-2's regex) does exactly this, and
its ByteLevel decoder undoes it (bytes that are not valid UTF-8 become U+FFFD,
as with Megatron's errors='replace').

As in Megatron's GPT2BPETokenizer (megatron/training/tokenizer), the text
"<|endoftext|>" is ordinary text (7 tokens): no special token is registered,
so a document can never smuggle in a document boundary. The boundary is
`eod`, the id of <|endoftext|> (50256), which preprocessing appends. GPT-2
has no pad token. (megatron.core.tokenizers goes through transformers'
GPT-2 tokenizer, which matches "<|endoftext|>" in text as 50256.)
"""

from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from mp_data.tokenizers.base import BackedTokenizer, digest, read_file

__all__ = ["GPT2BPETokenizer"]

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer(BackedTokenizer):
    """Megatron's GPT2BPETokenizer: byte-level BPE from vocab.json + merges.txt."""

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        self.vocab_file, self.merge_file = os.fspath(vocab_file), os.fspath(merge_file)
        vocab_bytes = read_file(self.vocab_file, "vocab_file of GPT2BPETokenizer")
        merge_bytes = read_file(self.merge_file, "merge_file of GPT2BPETokenizer")
        try:
            vocab, merges = models.BPE.read_file(self.vocab_file, self.merge_file)
        except Exception as e:  # tokenizers raises a bare Exception for bad files
            raise ValueError(
                f"{self.vocab_file}, {self.merge_file}: not a GPT-2 vocab.json and merges.txt: {e}"
            ) from e
        if END_OF_TEXT not in vocab:
            raise ValueError(f"{self.vocab_file}: no {END_OF_TEXT} token, which GPT-2 uses as eod")
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        self.backend = backend
        self.vocab_size = len(vocab)
        self.eod = vocab[END_OF_TEXT]
        self.eos = self.eod
        self.identity = "GPT2BPETokenizer:sha256=" + digest(
            [("vocab.json", vocab_bytes), ("merges.txt", merge_bytes)]
        )

    def detokenize(self, ids) -> str:
        return self._decode_tokens(ids)
