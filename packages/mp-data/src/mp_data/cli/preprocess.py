"""`mp-data preprocess`: JSON lines -> .bin/.idx, as Megatron's tools/preprocess_data.py.

Same options, same meaning, same files: for each --json-keys key K it writes
{output_prefix}_{K}_{level}.bin/.idx, level "document", or "sentence" with
--split-sentences, with tokens in DType.optimal_dtype(vocab_size) (uint16
below 65,500 entries, else int32). Given the same input and vocabulary files
the outputs are byte-identical to Megatron's: the documents are encoded as
its Encoder does (encode.py) and written in input order, whatever --workers.

Faster because the work goes to workers in blocks of about a megabyte of
lines (one tokenizer call per block and key, a few numpy arrays back) rather
than line by line, and because the input can be .jsonl.gz directly.

CPU use: this command sets TOKENIZERS_PARALLELISM=false, so each process
tokenizes on one thread and --workers alone decides how many cores are used
(plus the main process, which reads and writes).

--partitions N gives Megatron's document order: Megatron deals the input lines
out to N partition files in turn (line i to partition i mod N), encodes each
and concatenates them in partition order; here the input is read N times,
each pass encoding the lines of one partition (the others read as blank, so
line numbers in errors stay the file's), with no partition files. With
--keep-sequential-samples Megatron gives each partition a contiguous run of
lines instead, so the order is the input's, as without --partitions.

Outputs appear only complete: the builders write hidden temporaries beside the
targets and rename them at the end; any error, Ctrl-C or SIGTERM discards
them, and a killed run (SIGKILL) leaves only hidden `.*.tmp` files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from mp_data.cli.encode import EncodedBlock, EncodeOptions, Encoder
from mp_data.cli.errors import CliError
from mp_data.cli.input_file import InputFile
from mp_data.cli.progress import Progress, human
from mp_data.cli.workers import encoded_blocks
from mp_data.indexed_builder import IndexedDatasetBuilder
from mp_data.indexed_format import get_bin_path, get_idx_path
from mp_data.tokenizers import TOKENIZER_TYPES

__all__ = ["add_parser", "run"]

_BAD_LINES_SHOWN = 5


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess",
        help="tokenize JSON lines into .bin/.idx datasets (Megatron's preprocess_data.py)",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    p.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="input JSON lines, one document per line (.jsonl or .jsonl.gz)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        metavar="P",
        help="write P_{key}_{document|sentence}.bin/.idx for each --json-keys key",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="keys of each JSON object to tokenize, one dataset each (default: text)",
    )
    t = p.add_argument_group("tokenizer (Megatron's options)")
    t.add_argument(
        "--tokenizer-type",
        required=True,
        metavar="TYPE",
        help=f"one of {', '.join(TOKENIZER_TYPES)}",
    )
    t.add_argument(
        "--vocab-file",
        metavar="FILE",
        help="vocabulary: vocab.json (GPT2BPETokenizer) or vocab.txt (Bert*)",
    )
    t.add_argument("--merge-file", metavar="FILE", help="merges.txt of GPT2BPETokenizer")
    t.add_argument(
        "--tokenizer-model",
        metavar="PATH",
        help="tokenizer.json, or the folder holding it (HuggingFaceTokenizer)",
    )
    t.add_argument(
        "--vocab-size", type=int, metavar="N", help="ids 0..N-1, eod N-1 (NullTokenizer)"
    )
    t.add_argument(
        "--null-tokenizer-eod-id", type=int, metavar="ID", help="NullTokenizer's eod (default N-1)"
    )
    e = p.add_argument_group("encoding")
    e.add_argument(
        "--append-eod",
        action="store_true",
        help="append the tokenizer's end-of-document token to each document",
    )
    e.add_argument(
        "--special-tokens-as-text",
        action="store_true",
        help="tokenize the text of special tokens (<|endoftext|>, [SEP], ...) as ordinary "
        "text; by default it is the special token, as in Megatron, so a document "
        "containing '<|endoftext|>' holds an end of document there",
    )
    e.add_argument(
        "--split-sentences",
        action="store_true",
        help="split documents into sentences with Punkt; write sentence-level files",
    )
    e.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences, keep the whitespace after each sentence in it",
    )
    e.add_argument(
        "--lang",
        default="english",
        help="language of the Punkt model for --split-sentences (default: english)",
    )
    r = p.add_argument_group("runtime")
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes that tokenize, one core each (default: 1)",
    )
    r.add_argument(
        "--log-interval",
        type=int,
        default=10000,
        metavar="N",
        help="without a terminal, log progress every N documents (default: 10000)",
    )
    r.add_argument(
        "--partitions",
        type=int,
        default=1,
        metavar="N",
        help="Megatron's input partitions: line i goes to partition i mod N and the output "
        "holds partition 0's documents, then partition 1's, ... (the order Megatron's "
        "preprocess_data.py --partitions N writes); the input is read N times",
    )
    r.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="with --partitions, partitions are contiguous runs of lines (Megatron's flag): "
        "the documents keep the input's order",
    )
    r.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count bad lines (not JSON, a key missing, text the tokenizer "
        "rejects) instead of failing",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    # Before any tokenizer runs, here and in the forked workers: see the module docstring.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _check_numbers(args)
    source = InputFile(args.input)
    _check_output_folder(args.output_prefix)
    options = EncodeOptions(
        json_keys=tuple(args.json_keys),
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        null_tokenizer_eod_id=args.null_tokenizer_eod_id,
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        special_tokens_as_text=args.special_tokens_as_text,
    )
    try:
        encoder = Encoder(options)  # checks the files before any worker starts
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    level = "sentence" if args.split_sentences else "document"
    prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in options.json_keys}
    progress = Progress(sys.stderr, args.log_interval, source.fraction_read)
    bad_lines: list[tuple[int, str]] = []  # the first few, for the summary
    bad_count = 0
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_interrupt())
        builders = {
            key: stack.enter_context(IndexedDatasetBuilder(get_bin_path(p), encoder.dtype))
            for key, p in prefixes.items()
        }
        stack.callback(progress.close)
        results = stack.enter_context(
            encoded_blocks(options, _partitioned(source, args), args.workers, encoder)
        )
        for block in results:
            if block.bad_lines:
                if not args.skip_bad_lines:
                    line, reason = block.bad_lines[0]
                    raise CliError(
                        f"{source.path}:{line}: {reason} (--skip-bad-lines skips such lines)"
                    )
                bad_count += len(block.bad_lines)
                bad_lines.extend(block.bad_lines[: _BAD_LINES_SHOWN - len(bad_lines)])
            _write(block, builders)
            progress.update(block.documents, block.tokens, block.input_bytes)
        if progress.documents == 0:
            raise CliError(f"{source.path}: no documents ({_why_empty(source, bad_count)})")
        if progress.tokens == 0:
            raise CliError(f"{source.path}: {progress.documents} documents, but all are empty")
        for key, builder in builders.items():
            builder.finalize(get_idx_path(prefixes[key]))
    _summary(progress, bad_count, bad_lines, source, prefixes)


def _partitioned(source: InputFile, args) -> Iterator[tuple[int, bytes]]:
    """The input's blocks in Megatron's partition order (see the module docstring)."""
    n = args.partitions
    if n == 1 or args.keep_sequential_samples:
        yield from source.blocks()
        return
    for partition in range(n):
        for first, data in source.blocks():
            lines = data.split(b"\n")
            kept = [line if (first + i - 1) % n == partition else b""
                    for i, line in enumerate(lines)]  # fmt: skip
            yield first, b"\n".join(kept)
        if partition < n - 1:
            source.lines_read = 0  # the next pass numbers the lines again


def _write(block: EncodedBlock, builders: dict[str, IndexedDatasetBuilder]) -> None:
    for key, part in block.keys.items():
        builder = builders[key]
        token, sequence = 0, 0
        for n_sequences, n_tokens in zip(
            part.document_sequences, part.document_tokens, strict=True
        ):
            builder.add_document(
                part.tokens[token : token + n_tokens],
                part.sequence_lengths[sequence : sequence + n_sequences],
            )
            token += n_tokens
            sequence += n_sequences


def _check_numbers(args) -> None:
    if args.workers < 1:
        raise CliError(f"--workers must be at least 1, got {args.workers}")
    if args.partitions < 1:
        raise CliError(f"--partitions must be at least 1, got {args.partitions}")
    if args.log_interval < 1:
        raise CliError(f"--log-interval must be at least 1, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise CliError(f"--json-keys names a key twice: {' '.join(args.json_keys)}")


def _check_output_folder(prefix: str) -> None:
    folder = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        raise CliError(f"--output-prefix {prefix}: the folder {folder} does not exist")


def _why_empty(source: InputFile, bad_count: int) -> str:
    if bad_count:
        return f"all {bad_count} non-blank lines were skipped as bad"
    if source.lines_read:
        return f"{source.lines_read} lines, all blank"
    return "the file is empty"


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a cancelled cluster job) unwinds like Ctrl-C, so outputs are discarded."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _summary(progress: Progress, bad_count: int, bad_lines, source: InputFile, prefixes) -> None:
    seconds = max(progress.seconds, 1e-9)
    print(
        f"{progress.documents:,} documents, {progress.tokens:,} tokens, "
        f"{bad_count} bad lines skipped, {seconds:.1f} s, "
        f"{human(progress.tokens / seconds)} tokens/s, "
        f"{progress.input_bytes / seconds / 1e6:.1f} MB/s"
    )
    if bad_lines:
        shown = ", ".join(str(line) for line, _ in bad_lines[:_BAD_LINES_SHOWN])
        more = ", ..." if bad_count > len(bad_lines) else ""
        line, reason = bad_lines[0]
        print(f"skipped lines of {source.path}: {shown}{more} (line {line}: {reason})")
    for prefix in prefixes.values():
        print(f"wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}")
