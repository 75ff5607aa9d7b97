"""GPT-2's byte-level BPE, from its vocab.json and merges.txt, with Megatron's ids.

The pipeline is the original GPT-2 encoder's: GPT-2's regular expression
splits the text into words (contractions, letters, digits, other symbols,
whitespace runs), each word's UTF-8 bytes are mapped to printable characters,
and the merges are applied by rank. Tokenizers' BPE model with the ByteLevel
pre-tokenizer (add_prefix_space=False, GPT-2's regex) does exactly this, and
its ByteLevel decoder undoes it (bytes that are not valid UTF-8 become U+FFFD,
as with Megatron's errors='replace').

Ids are those of megatron-core 0.19's GPT2BPETokenizer, which is transformers'
GPT-2 tokenizer built from the same two files: "<|endoftext|>" is a special
token, so the literal text "<|endoftext|>" anywhere in a document becomes the
one id 50256, the same id as `eod`, which preprocessing appends after each
document ("Hello <|endoftext|> world" -> [15496, 220, 50256, 995]). The text
around it is tokenized on its own, as if the special token were a document
edge.

That lets a document's text inject document boundaries. With
`special_tokens_as_text=True` the text is ordinary text instead (7 tokens,
[27, 91, 437, 1659, 5239, 91, 29]), as in the tokenizer Megatron used before
megatron.core.tokenizers (megatron/training/tokenizer, --legacy-tokenizer).

bos and eos are <|endoftext|> too (transformers' GPT-2 roles); GPT-2 has no
pad token.
"""

from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from mp_data.tokenizers.base import BackedTokenizer, read_file

__all__ = ["GPT2BPETokenizer"]

END_OF_TEXT = "<|endoftext|>"


class GPT2BPETokenizer(BackedTokenizer):
    """Megatron's GPT2BPETokenizer: byte-level BPE from vocab.json + merges.txt."""

    def __init__(
        self,
        vocab_file: str | os.PathLike,
        merge_file: str | os.PathLike,
        special_tokens_as_text: bool = False,
    ) -> None:
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
        backend.add_special_tokens([tokenizers.AddedToken(END_OF_TEXT, special=True)])
        self._set_backend(backend, special_tokens_as_text)
        self.vocab_size = len(vocab)
        self.eod = vocab[END_OF_TEXT]
        self.eos = self.bos = self.eod
        self.identity = self._identity(
            "GPT2BPETokenizer", [("vocab.json", vocab_bytes), ("merges.txt", merge_bytes)]
        )

    def detokenize(self, ids) -> str:
        return self._decode_tokens(ids)
