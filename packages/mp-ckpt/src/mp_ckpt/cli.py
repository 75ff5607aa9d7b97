"""The mp-ckpt command line: inspect, convert, export-hf, import-hf, import/export-megatron.

    mp-ckpt inspect DIR [--json] [--verify]
    mp-ckpt convert DIR OUT --tensor-model-parallel-size N --pipeline-model-parallel-size M
    mp-ckpt export-hf DIR OUT [--arch FAMILY] [--max-shard-size 5GB]
                      [--dtype bf16]
    mp-ckpt import-hf HF_DIR OUT          (the architecture is config.json's model_type)
    mp-ckpt import-megatron SRC OUT [--iteration N]   (a Megatron-LM training checkpoint:
                                          torch_dist or legacy torch, any TP x PP x EP)
    mp-ckpt export-megatron DIR OUT [--ckpt-format torch_dist|torch]
                      [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]
                      [--expert-model-parallel-size E]
                                          (a Megatron-LM training checkpoint; model only)

DIR is a checkpoint root (with latest_checkpointed_iteration.txt) or one
iter_XXXXXXX directory; --iteration picks another than the latest.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

# torch and the converters are imported by the command that needs them: `mp-ckpt --help`
# answers in a fraction of the seconds torch takes to import.
from mp_ckpt.families import ARCHITECTURES

__all__ = ["main"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--dtype -> the torch dtype's name."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, KeyError, ValueError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"mp-ckpt {args.command}: error: {message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mp-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="iteration, layout and every logical tensor")
    inspect.add_argument("dir")
    inspect.add_argument("--iteration", type=int)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--verify", action="store_true", help="check every file's sha256")
    inspect.set_defaults(run=_inspect)

    convert = sub.add_parser("convert", help="rewrite for another TP x PP layout, offline")
    convert.add_argument("dir")
    convert.add_argument("out")
    convert.add_argument("--iteration", type=int)
    convert.add_argument("--tensor-model-parallel-size", type=int, default=1)
    convert.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    convert.set_defaults(run=_convert)

    export = sub.add_parser("export-hf", help="a Hugging Face directory transformers loads")
    export.add_argument("dir")
    export.add_argument("out")
    export.add_argument(
        "--arch", choices=ARCHITECTURES,
        help="default: the family the checkpoint was imported as, else the one its settings "
        "describe",
    )  # fmt: skip
    export.add_argument("--iteration", type=int)
    export.add_argument("--max-shard-size", default="5GB", help="e.g. 500MB, 5GB")
    export.add_argument("--dtype", choices=sorted(_DTYPES), help="default: as saved")
    export.set_defaults(run=_export)

    imported = sub.add_parser("import-hf", help="an mp checkpoint from a Hugging Face directory")
    imported.add_argument("hf_dir")
    imported.add_argument("out")
    imported.set_defaults(run=_import)

    megatron = sub.add_parser(
        "import-megatron", help="an mp checkpoint from a Megatron-LM training checkpoint"
    )
    megatron.add_argument("src", help="a Megatron --save root or one iter_XXXXXXX directory")
    megatron.add_argument("out")
    megatron.add_argument("--iteration", type=int, help="default: the tracker's")
    megatron.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also the Adam (and Muon) state, scheduler and iteration (at the source iteration)",
    )
    megatron.set_defaults(run=_import_megatron)

    to_megatron = sub.add_parser(
        "export-megatron", help="a Megatron-LM training checkpoint of the model (no optimizer)"
    )
    to_megatron.add_argument("dir")
    to_megatron.add_argument("out")
    to_megatron.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist")
    to_megatron.add_argument("--tensor-model-parallel-size", type=int, default=1)
    to_megatron.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    to_megatron.add_argument("--expert-model-parallel-size", type=int, default=1)
    to_megatron.set_defaults(run=_export_megatron)
    for command in (convert, export, imported, megatron, to_megatron):
        command.add_argument(
            "--no-progress", action="store_true",
            help="no progress on stderr (a bar on a terminal, else lines)",
        )  # fmt: skip
    return parser


def _inspect(args) -> int:
    import torch

    from mp_ckpt.core.reader import CheckpointReader

    reader = CheckpointReader(args.dir, iteration=args.iteration)
    meta = reader.metadata
    rows = []
    for key, entry in meta["tensors"].items():
        dtype = getattr(torch, entry["dtype"])
        numel = math.prod(entry["shape"])
        rows.append({"name": key, "shape": entry["shape"], "dtype": entry["dtype"],
                     "bytes": numel * dtype.itemsize, "numel": numel})  # fmt: skip
    model = [r for r in rows if not r["name"].startswith("optimizer.")]
    summary = {
        "directory": str(reader.directory),
        "iteration": meta["iteration"],
        "saved_by_ranks": meta["world_size"],
        "layout": meta.get("layout", {}),
        "tensors": rows,
        "total_tensors": len(rows),
        "total_bytes": sum(r["bytes"] for r in rows),
        "model_parameters": sum(r["numel"] for r in model),
    }
    if args.verify:
        summary["problems"] = reader.verify()
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['directory']}: iteration {summary['iteration']}, saved by "
              f"{summary['saved_by_ranks']} ranks, layout {summary['layout']}")  # fmt: skip
        width = max((len(r["name"]) for r in rows), default=4)
        for r in rows:
            shape = "x".join(map(str, r["shape"])) or "scalar"
            print(f"  {r['name']:<{width}}  {shape:>18}  {r['dtype']:>8}  {_size(r['bytes']):>10}")
        print(f"{summary['total_tensors']} tensors, {_size(summary['total_bytes'])}; "
              f"{summary['model_parameters']:,} model parameters")  # fmt: skip
        if args.verify:
            print(
                "integrity: "
                + ("ok" if not summary["problems"] else "; ".join(summary["problems"]))
            )
    return 1 if args.verify and summary["problems"] else 0


def _convert(args) -> int:
    from mp_ckpt.core.reshard import convert_checkpoint

    out = convert_checkpoint(
        args.dir, args.out, iteration=args.iteration,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"wrote {out}")
    return 0


def _export(args) -> int:
    import torch

    from mp_ckpt.hf import export_hf

    out = export_hf(args.dir, args.out, args.arch, iteration=args.iteration,
                    max_shard_bytes=_parse_size(args.max_shard_size),
                    dtype=getattr(torch, _DTYPES[args.dtype]) if args.dtype else None,
                    progress=not args.no_progress)  # fmt: skip
    print(f"wrote {out}")
    return 0


def _import(args) -> int:
    from mp_ckpt.hf import import_hf

    out = import_hf(args.hf_dir, args.out, progress=not args.no_progress)
    print(f"wrote {out}")
    return 0


def _import_megatron(args) -> int:
    from mp_ckpt.megatron.importer import import_megatron

    out = import_megatron(
        args.src, args.out, iteration=args.iteration, with_optimizer=args.with_optimizer,
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"wrote {out}")
    return 0


def _export_megatron(args) -> int:
    from mp_ckpt.megatron.write import export_megatron

    out = export_megatron(
        args.dir, args.out, ckpt_format=args.ckpt_format,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        progress=not args.no_progress,
    )  # fmt: skip
    print(f"wrote {out} (model weights only: Megatron loads it with --no-load-optim --no-load-rng)")
    return 0


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 500MB or 5GB")
    scale = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}[(match.group(2) or "").upper()]
    return int(float(match.group(1)) * scale)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
