"""Writes the defaults of Megatron-LM's command-line flags, for mp-train's test of its own.

    $MCORE_VENV/bin/python ci/gen_megatron_flag_defaults.py
    python ci/gen_megatron_flag_defaults.py --megatron-src DIR   # a Megatron-LM checkout

Run it where megatron.training imports: with megatron-core installed
(../shared/megatron-cpu/README.md sets one up on a CPU machine), or with --megatron-src
naming a Megatron-LM source tree (its `megatron` package is imported from there; the
committed file came from a snapshot of Megatron-LM's main branch, its commit in the
file). It builds the parser of Megatron-LM's training scripts
(megatron.training.arguments.add_megatron_arguments), parses an empty command line and
writes, for every option string but --help, the destination and the value it takes when
left out, to packages/mp-train/tests/assets/megatron_flag_defaults.json
(test_megatron_defaults.py compares mp's defaults with them). Values Megatron-LM's
argument validation derives later (a None it fills in) are recorded as None, as parsed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import typing
from pathlib import Path

OUT = (Path(__file__).resolve().parents[1] / "packages" / "mp-train" / "tests" / "assets"
       / "megatron_flag_defaults.json")  # fmt: skip


def _plain(value):
    """A default as JSON holds it: tuples as lists, anything else not JSON-able (a dtype, an
    enum, a callable) as its repr under {"repr": ...}."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return {"repr": repr(value)}


def defaults() -> dict[str, dict]:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    parsed = vars(parser.parse_args([]))
    flags = {}
    for action in parser._actions:
        for name in action.option_strings:
            if name in ("-h", "--help"):
                continue
            flags[name] = {"dest": action.dest, "default": _plain(parsed.get(action.dest))}
    return dict(sorted(flags.items()))


def _source(src: Path | None) -> str:
    if src is None:
        import importlib.metadata

        return f"megatron-core {importlib.metadata.version('megatron-core')}"
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    return f"Megatron-LM {commit or 'source tree ' + str(src)}"


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--megatron-src", type=Path, help="a Megatron-LM source tree to import")
    cli.add_argument("--source", help="what to record as the source (default: found)")
    args = cli.parse_args()
    if args.megatron_src is not None:
        sys.path.insert(0, str(args.megatron_src))
        if not hasattr(typing, "override"):  # Python < 3.12; a decorator without effect
            typing.override = lambda f: f
    flags = defaults()
    source = args.source or _source(args.megatron_src)
    OUT.write_text(json.dumps({"source": source, "flags": flags}, indent=1) + "\n")
    print(f"{OUT}: {len(flags)} flags from {source}")


if __name__ == "__main__":
    main()
