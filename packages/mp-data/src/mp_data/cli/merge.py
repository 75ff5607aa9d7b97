"""`mp-data merge`: concatenate .bin/.idx datasets, as Megatron's tools/merge_datasets.py.

Each --input is a dataset prefix (P for P.bin + P.idx; a path ending in .bin
or .idx is taken as its prefix) or a folder. A folder stands for every
dataset in it, in sorted order of name, as Megatron's merge_datasets.py
reads its --input folder; hidden files (the builders' temporaries) are
ignored, and so is the output itself when it is written into that folder.
The datasets are appended in the order given (mp_data.merge_datasets: same
bytes as Megatron's IndexedDatasetBuilder.add_index); their dtypes must match.
"""

from __future__ import annotations

import argparse
import os
import sys

from mp_data.cli.errors import CliError
from mp_data.indexed_builder import merge_datasets
from mp_data.indexed_dataset import IndexedDataset
from mp_data.indexed_format import get_bin_path, get_idx_path

__all__ = ["add_parser", "dataset_prefix", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "merge",
        help="concatenate .bin/.idx datasets into one (Megatron's merge_datasets.py)",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PREFIX",
        help="datasets to append, in order: prefixes, or folders (all datasets in them, sorted)",
    )
    p.add_argument(
        "--output-prefix", required=True, metavar="OUT", help="write OUT.bin and OUT.idx"
    )
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else lines)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    output = args.output_prefix
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise CliError(f"--output-prefix {output}: the folder {folder} does not exist")
    prefixes: list[str] = []
    for item in args.input:
        if os.path.isdir(item):
            found = _datasets_in(item, output)
            if not found:
                raise CliError(f"{item}: no datasets (pairs of P.bin and P.idx) in this folder")
            prefixes.extend(found)
        else:
            prefix = dataset_prefix(item)
            if os.path.abspath(prefix) == os.path.abspath(output):
                raise CliError(f"--input {item} is also the --output-prefix")
            prefixes.append(prefix)
    try:
        merged = merge_datasets(prefixes, output, progress=not args.no_progress)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    tokens = int(merged.sequence_lengths.sum(dtype="int64"))
    print(
        f"merged {len(prefixes)} datasets: {len(merged):,} sequences, "
        f"{merged.document_count:,} documents, {tokens:,} tokens ({merged.dtype.name})"
    )
    print(f"wrote {get_bin_path(output)} and {get_idx_path(output)}")


def dataset_prefix(path: str) -> str:
    """The prefix of a dataset named by its prefix, its .bin or its .idx; checks both exist."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if not IndexedDataset.exists(prefix):
        missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not os.path.isfile(p)]
        raise CliError(f"{prefix}: not a dataset ({' and '.join(missing)} not found)")
    return prefix


def _datasets_in(folder: str, output: str) -> list[str]:
    names = [n for n in os.listdir(folder) if not n.startswith(".")]
    files = {n for n in names if os.path.isfile(os.path.join(folder, n))}
    stems = {n[:-4] for n in files if n.endswith((".bin", ".idx"))}
    prefixes = []
    for stem in sorted(stems):
        prefix = os.path.join(folder, stem)
        if os.path.abspath(prefix) == os.path.abspath(output):
            continue  # a previous run's output: merging it in again would double it
        if f"{stem}.bin" in files and f"{stem}.idx" in files:
            prefixes.append(prefix)
        else:
            # Megatron stops here; a half dataset is worth a warning, not the run.
            print(f"mp-data merge: warning: skipping {prefix}: no .bin/.idx pair", file=sys.stderr)
    return prefixes
