"""Tokenizers with Megatron-LM's types, names and ids, on Hugging Face's `tokenizers`.

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json",
                                merge_file="merges.txt")
    tokenizer.tokenize("Hello world")  # [15496, 995]
    tokenizer.eod                      # 50256
    vocab_size_with_padding(tokenizer.vocab_size)  # 50304

Every tokenizer has vocab_size, tokenize, tokenize_batch, detokenize, eod,
pad, bos and identity (base.py says what each means); those read from
vocabulary files also have vocab and inv_vocab. One file per type:

    gpt2.py         GPT2BPETokenizer: GPT-2's byte-level BPE (vocab.json + merges.txt)
    bert.py         BertWordPieceLowerCase, BertWordPieceCase: BERT's WordPiece (vocab.txt)
    huggingface.py  HuggingFaceTokenizer: any local tokenizer.json
    null.py         NullTokenizer: the text is the ids
    build.py        build_tokenizer (Megatron's type names), vocab_size_with_padding

Megatron has two tokenizer systems: megatron/training/tokenizer, which its
preprocess_data.py and training used for years and which --legacy-tokenizer
still selects, and megatron.core.tokenizers (through transformers), which
megatron-core 0.19's preprocess_data.py and training use. mp follows the
second: special-token text in a document is the special token, and BERT
wraps every encoded text in [CLS] ... [SEP]. `special_tokens_as_text=True`
treats special-token text as ordinary text; each module docstring names what
the older system did differently.
"""

from mp_data.tokenizers.base import Tokenizer
from mp_data.tokenizers.bert import BertWordPieceCase, BertWordPieceLowerCase
from mp_data.tokenizers.build import TOKENIZER_TYPES, build_tokenizer, vocab_size_with_padding
from mp_data.tokenizers.gpt2 import GPT2BPETokenizer
from mp_data.tokenizers.huggingface import HuggingFaceTokenizer
from mp_data.tokenizers.null import NullTokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceCase",
    "BertWordPieceLowerCase",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "vocab_size_with_padding",
]
