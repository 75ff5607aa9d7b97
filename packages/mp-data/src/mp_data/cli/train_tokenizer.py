"""`mp-data train-tokenizer`: a GPT-2-style byte-level BPE for users with no vocabulary.

Trains with Hugging Face `tokenizers` on the --json-keys texts of a JSON-lines
file: GPT-2's pre-tokenization (ByteLevel, GPT-2's regex, no prefix space),
the 256 byte symbols as the initial alphabet (so every text is encodable),
and "<|endoftext|>" as the one special token (id 0), which Megatron's GPT-2
tokenizer uses as eod. --vocab-size counts all of these.

Writes to --output:
    vocab.json, merges.txt  for --tokenizer-type GPT2BPETokenizer
    tokenizer.json          for --tokenizer-type HuggingFaceTokenizer
Both give the same ids for ordinary text. Training uses every core (the
library's own threads).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mp_data.cli.encode import BadLine, parse_line
from mp_data.cli.errors import CliError
from mp_data.cli.input_file import InputFile

__all__ = ["END_OF_TEXT", "add_parser", "run"]

END_OF_TEXT = "<|endoftext|>"
_ALPHABET = 256  # byte symbols


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE (GPT-2 style) on JSON lines",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input", required=True, metavar="FILE", help="training text: .jsonl or .jsonl.gz"
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys of each JSON object whose text is trained on (default: text)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help=f"tokens in the vocabulary, the {_ALPHABET} bytes and {END_OF_TEXT} included",
    )
    p.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="folder for vocab.json, merges.txt, tokenizer.json",
    )
    p.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        metavar="N",
        help="merge only pairs seen at least N times (default: 2)",
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip lines that are not valid JSON or lack a key",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    if args.vocab_size < _ALPHABET + 1:
        raise CliError(
            f"--vocab-size {args.vocab_size}: must be at least {_ALPHABET + 1} "
            f"({_ALPHABET} byte tokens and {END_OF_TEXT})"
        )
    if args.min_frequency < 0:
        raise CliError(f"--min-frequency must be at least 0, got {args.min_frequency}")
    source = InputFile(args.input)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise CliError(f"--output {args.output}: exists and is not a folder")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    counts = {"documents": 0, "bad": 0}
    tokenizer.train_from_iterator(_texts(source, args, counts), trainer)
    if counts["documents"] == 0:
        raise CliError(f"{source.path}: no documents to train on")
    os.makedirs(args.output, exist_ok=True)
    tokenizer.model.save(args.output)  # vocab.json and merges.txt
    tokenizer.save(os.path.join(args.output, "tokenizer.json"))
    print(
        f"trained on {counts['documents']:,} documents ({counts['bad']} bad lines skipped): "
        f"{tokenizer.get_vocab_size():,} tokens"
    )
    print(f"wrote {', '.join(os.path.join(args.output, n) for n in _FILES)}")


_FILES = ("vocab.json", "merges.txt", "tokenizer.json")


def _texts(source: InputFile, args, counts: dict[str, int]) -> Iterator[list[str]]:
    """One list of texts per block of lines (batches cross into the library cheaply)."""
    keys = tuple(args.json_keys)
    for first, data in source.blocks():
        batch = []
        for offset, raw in enumerate(data.split(b"\n")):
            if not raw or raw.isspace():
                continue
            try:
                per_key = parse_line(raw, keys)
            except BadLine as e:
                if not args.skip_bad_lines:
                    raise CliError(
                        f"{source.path}:{first + offset}: {e} (--skip-bad-lines skips such lines)"
                    ) from None
                counts["bad"] += 1
                continue
            batch.extend(text for sentences in per_key for text in sentences)
            counts["documents"] += 1
        yield batch
