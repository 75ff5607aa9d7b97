"""The `mp-data` command: datasets for pretraining, from JSON lines to .bin/.idx.

    mp-data preprocess --input corpus.jsonl.gz --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \\
        --merge-file merges.txt --append-eod --workers 8
    mp-data merge --input data/ --output-prefix data/all
    mp-data inspect data/corpus_text_document
    mp-data train-tokenizer --input corpus.jsonl --vocab-size 32000 --output tok/

Commands, one module each:

    preprocess.py       Megatron's tools/preprocess_data.py: same options, same files
                        (encode.py, sentences.py, workers.py, input_file.py, progress.py)
    merge.py            Megatron's tools/merge_datasets.py
    inspect_dataset.py  counts, sizes and length statistics of a dataset
    train_tokenizer.py  a byte-level BPE vocabulary for GPT2BPETokenizer / HuggingFaceTokenizer

`main(argv)` returns the exit status: 0, 1 for an error the user can fix (one
line on stderr naming the file, line, option or value; see errors.py), 2 for
a bad command line (argparse), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mp_data.cli import inspect_dataset, merge, preprocess, train_tokenizer
from mp_data.cli.errors import CliError

__all__ = ["CliError", "build_parser", "main"]

_COMMANDS = (preprocess, merge, inspect_dataset, train_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mp-data",
        description="Datasets for pretraining: tokenize JSON lines into Megatron's .bin/.idx "
        "files, merge and inspect them, train a tokenizer.",
        epilog="Run `mp-data COMMAND --help` for the options of a command.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except CliError as e:
        _error(args.command, str(e))
        return 1
    except OSError as e:  # disk full, permission denied: the message names the file
        _error(args.command, str(e))
        return 1
    except KeyboardInterrupt:
        _error(args.command, "interrupted; no output was written")
        return 130
    return 0


def _error(command: str, message: str) -> None:
    sys.stdout.flush()
    print(f"mp-data {command}: error: {message}", file=sys.stderr)
