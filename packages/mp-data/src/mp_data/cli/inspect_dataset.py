"""`mp-data inspect`: what a .bin/.idx dataset holds, read from its index.

Counts (sequences, documents, tokens), the token dtype, the file sizes and
the distribution of sequence lengths come from the .idx alone, so inspecting
a dataset of billions of tokens takes a moment. With a tokenizer (the same
options as preprocess) it also decodes the start of the first document, to
check by eye that the dataset and the vocabulary belong together.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from mp_data.cli.errors import CliError
from mp_data.cli.merge import dataset_prefix
from mp_data.indexed_dataset import IndexedDataset
from mp_data.indexed_format import get_bin_path, get_idx_path
from mp_data.tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="print a dataset's counts, dtype, sizes and length statistics",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("prefix", metavar="PREFIX", help="the dataset: P for P.bin and P.idx")
    t = p.add_argument_group("tokenizer, to decode the first document (optional)")
    t.add_argument("--tokenizer-type", metavar="TYPE", help=f"one of {', '.join(TOKENIZER_TYPES)}")
    t.add_argument("--vocab-file", metavar="FILE", help="vocab.json or vocab.txt")
    t.add_argument("--merge-file", metavar="FILE", help="merges.txt of GPT2BPETokenizer")
    t.add_argument("--tokenizer-model", metavar="PATH", help="tokenizer.json or its folder")
    t.add_argument("--vocab-size", type=int, metavar="N", help="vocabulary size of NullTokenizer")
    t.add_argument(
        "--chars",
        type=int,
        default=300,
        metavar="N",
        help="show at most N characters of the decoded document (default: 300)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    prefix = dataset_prefix(args.prefix)
    try:
        dataset = IndexedDataset(prefix)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    lengths = dataset.sequence_lengths.astype(np.int64)
    tokens = int(lengths.sum())
    print(f"dataset:    {prefix}")
    print(f"dtype:      {dataset.dtype.name}")
    print(f"sequences:  {len(dataset):,}")
    print(f"documents:  {dataset.document_count:,}")
    print(f"tokens:     {tokens:,}")
    for path in (get_bin_path(prefix), get_idx_path(prefix)):
        print(f"{path[-4:]} file:  {os.path.getsize(path):,} bytes")
    if len(lengths):
        print(f"sequence length:  {_stats(lengths)}")
    document_tokens = _document_tokens(dataset, lengths)
    if (np.diff(dataset.document_indices) > 1).any():  # sentence-level: documents differ
        print(f"document length:  {_stats(document_tokens)}")
    empty = int((document_tokens == 0).sum())
    if empty:
        print(f"empty documents:  {empty:,}")
    if args.tokenizer_type:
        _show_first_document(args, dataset)


def _stats(values: np.ndarray) -> str:
    return (
        f"min {int(values.min()):,}, mean {values.mean():,.1f}, "
        f"median {np.median(values):,.1f}, max {int(values.max()):,}"
    )


def _document_tokens(dataset: IndexedDataset, lengths: np.ndarray) -> np.ndarray:
    """Tokens per document: the sums of its sequences (0 for an empty document)."""
    ends = np.concatenate([[0], np.cumsum(lengths)])
    bounds = dataset.document_indices
    return ends[bounds[1:]] - ends[bounds[:-1]]


def _show_first_document(args, dataset: IndexedDataset) -> None:
    try:
        tokenizer = build_tokenizer(
            args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
        )
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    bounds = dataset.document_indices
    if dataset.document_count == 0 or bounds[1] == bounds[0]:
        print("first document: (empty)")
        return
    ids = np.concatenate(dataset[int(bounds[0]) : int(bounds[1])])
    try:
        text = tokenizer.detokenize(ids.tolist())
    except ValueError as e:
        raise CliError(f"{dataset.path_prefix}: the first document does not decode: {e}") from None
    shown = text[: args.chars]
    cut = f", first {len(shown):,} shown" if len(shown) < len(text) else ""
    print(f"first document ({len(ids):,} tokens, {len(text):,} characters{cut}):")
    print(repr(shown) + ("..." if cut else ""))
