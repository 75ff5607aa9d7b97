"""Trains each tiny model at many parallel layouts and compares each with its one-rank run.

    uv run python ci/sweep_layouts.py                   # every group (about 3 minutes)
    uv run python ci/sweep_layouts.py moe deepseek      # some groups
    uv run python ci/sweep_layouts.py --list            # the groups and their layouts
    uv run python ci/sweep_layouts.py --with="--calculate-per-token-loss"   # every run
    uv run python ci/sweep_layouts.py --with-layouts="--num-distributed-optimizer-instances 2"
    uv run python ci/sweep_layouts.py --resume          # checkpoints across layouts
    uv run python ci/sweep_layouts.py --export          # exports for transformers too
    uv run python ci/sweep_layouts.py --resume-here --tolerance 0 --with="--hidden-dropout 0.1"

Each group is a tiny model (apps/gpt's tiny configs, fp32, dropout 0, mock data; the sft
groups on packed chat conversations and the blend group on two indexed corpora, each
conversation or document attending to itself alone) trained 3
iterations of 8 sequences, with two evaluations and the test split's at the end: once on
one rank, then at each of its layouts on forked gloo ranks (mp_state.testing.run_on_ranks).
A layout passes when every iteration's loss and gradient norm, and each evaluation's loss,
are within 1e-5 relative of the one-rank run's (--tolerance). --with adds flags to every
run, the one-rank ones included, to cross a feature with every layout; --with-layouts adds
them to the layouts' runs only (a feature one rank refuses, such as
--num-distributed-optimizer-instances). The gradient norm
is what shows a gradient scaled wrongly: Adam's update hardly changes when one
parameter's gradient is scaled, so the losses alone would not.

--resume checks checkpoints across layouts instead: the one-rank run trains 4 iterations,
saving at 2 and 4; each layout trains 2 iterations and saves, that checkpoint resumes on
one rank, and the one-rank run's save of iteration 2 resumes at the layout. Both resumed
runs' iterations 3 and 4, and their evaluations, must be the one-rank run's.
--export adds --export-hf-dir to every run: besides the curve, each layout's export (the
model gathered from its shards at the end of training, as transformers reads it) must hold
the files, config.json and tensors of one rank's, each tensor within EXPORT_TOLERANCE, and
mp-ckpt's export of the run's final checkpoint must be it bit for bit; some groups take
flags that make their model one transformers has (EXPORT_FLAGS), the MTP group none
(NOT_EXPORTED).
--resume-here resumes each layout's own save of iteration 2 at the layout against that
run's iterations 3 and 4 (no one-rank run): with --tolerance 0 and dropout, that each rank
takes back its random streams and the data where it stopped.

The tests check a representative layout of each feature; this crosses them (8 ranks
where it takes them) and is run by hand after a change to the groups, the schedules, the
optimizers or the sharding. It found the distributed optimizer's tied-embedding buckets,
FSDP's expert gradients over a group of one, the uneven pipeline split refused at three
stages, the validation iterators missing with virtual stages on ranks that read no
data, and FSDP's checkpoints saved after an evaluation without the optimizer state of the
parameters it had left gathered (mp-optim's and mp-train's CHANGELOGs). Exit status 1
when a layout differs or fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
from safetensors.torch import load_file

from mp_ckpt import export_hf
from mp_data import IndexedDatasetBuilder, write_chat_corpus, write_chat_tokenizer
from mp_gpt.config_files import config_path
from mp_gpt.testing import (
    GIVEN_PEAK,
    HYBRID_OPTIONS,
    metrics_records,
    tiny_moe_options,
    tiny_options,
    train_output_on_rank,
)
from mp_state.testing import run_on_ranks

TOLERANCE = 1e-5
# Two evaluations (at iteration 2 and the final one) of 2 global batches each; a rank that
# waits for a peer gives up after a minute.
RUN = ["--global-batch-size", "8", "--train-iters", "3", "--eval-interval", "2",
       "--eval-iters", "2", "--distributed-timeout-minutes", "1"]  # fmt: skip
# --resume and --resume-here: 4 iterations, saved every 2, evaluated at 2 and 4 (and the
# test split's at the end)
RESUME_RUN = [*RUN, "--train-iters", "4", "--save-interval", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]
CP2 = ["--context-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
EP4 = ["--expert-model-parallel-size", "4"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]


def _run(config: str, run_dir: Path) -> list[str]:
    """A tiny config's run (64 tokens, micro-batches of one, metrics to run_dir), no data."""
    return [
        "--config", str(config_path(config)), *GIVEN_PEAK,
        "--seq-length", "64", "--micro-batch-size", "1", "--eval-interval", "none",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--lr-warmup-iters", "1", "--metrics-file", str(run_dir / "metrics.jsonl"),
    ]  # fmt: skip


def _small(config: str):
    """Options of a tiny config written for one rank, on mock data."""

    def options(run_dir: Path, *extra: str) -> list[str]:
        return [*_run(config, run_dir), "--mock-data", *extra]

    return options


def _sft(config: str):
    """Options of a tiny config trained with --sft on packed chat conversations (made once,
    in the sweep's folder): 64 tokens, micro-batches of one, no loss on the prompts. The
    vocabulary (1,119 ids) padded to a multiple of 64 at one rank is 1,152, a multiple of
    128 too: the same model at TP2, which pads to a multiple of 64 x tp."""

    def options(run_dir: Path, *extra: str) -> list[str]:
        data = run_dir.parent.parent / "chat"  # the sweep's folder / group / run
        if not (data / "chat.jsonl").exists():
            write_chat_tokenizer(str(data / "tokenizer"))
            write_chat_corpus(str(data / "chat.jsonl"), 200, long_every=50, long_words=60)
        return [
            *_run(config, run_dir), "--sft", "--sft-tokenizer-prompt-format", "default",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            str(data / "tokenizer"), "--data-path", str(data / "chat.jsonl"), "--split",
            "90,5,5", "--data-cache-path", str(run_dir / "cache"),
            "--make-vocab-size-divisible-by", "64", *extra,
        ]  # fmt: skip

    return options


def _blend(config: str):
    """Options of a tiny config trained on a blend of two indexed corpora (made once, in the
    sweep's folder; documents of 20 to 90 tokens, NullTokenizer's ids), split 90/5/5:
    the datasets, their blend and the sampler as a run on files reads them."""

    def options(run_dir: Path, *extra: str) -> list[str]:
        data = run_dir.parent.parent / "blend"  # the sweep's folder / group / run
        if not (data / "b.idx").exists():
            data.mkdir(parents=True, exist_ok=True)
            for seed, name in enumerate("ab"):
                _corpus(str(data / name), seed, 300)
        return [
            *_run(config, run_dir), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--make-vocab-size-divisible-by", "512", "--data-path", "0.3", str(data / "a"),
            "0.7", str(data / "b"), "--split", "90,5,5", "--data-cache-path",
            str(run_dir / "cache"), *extra,
        ]  # fmt: skip

    return options


def _corpus(prefix: str, seed: int, documents: int) -> None:
    """An indexed corpus of random documents, each ending with NullTokenizer's EOD (999)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        for _ in range(documents):
            builder.add_item(np.append(rng.integers(0, 999, rng.integers(20, 90)), 999))
            builder.end_document()
        builder.finalize(prefix + ".idx")


# group -> (options(run_dir, *extra), the group's own flags, [(layout, ranks, flags)])
GROUPS = {
    "dense": (tiny_options, [], [
        ("pp4 x dp2, distopt, overlap", 8, ["--pipeline-model-parallel-size", "4", *DISTOPT,
                                            *OVERLAP]),
        ("tp2+sp x pp2 x vpp2 x dp2, distopt, overlap", 8, [*TP2, *VPP2, *DISTOPT, *OVERLAP]),
        ("cp2 x tp2+sp x pp2, distopt", 8, [*CP2, *TP2, *PP2, *DISTOPT]),
        ("cp2 a2a x pp2 x dp2, distopt", 8, [*CP2, "--cp-comm-type", "a2a", *PP2, *DISTOPT]),
        ("cp4 a2a+p2p (2 x 2)", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                    "--hierarchical-context-parallel-sizes", "2", "2"]),
        ("pp3 (2 + 1 + 1) x dp2", 6, ["--pipeline-model-parallel-size", "3",
                                      "--decoder-first-pipeline-num-layers", "2"]),
        ("zero3 x tp2+sp x cp2", 8, [*ZERO3, *TP2, *CP2]),
        ("pp2 x vpp2 x dp2, full recompute, distopt, tp2", 8, [
            *VPP2, *TP2, *DISTOPT, "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ]),
    "untied": (tiny_options, ["--untie-embeddings-and-output-weights"], [
        ("pp2 x vpp2 x dp2, distopt, overlap", 4, [*VPP2, *DISTOPT, *OVERLAP]),
        ("tp2+sp x pp2 x dp2, zero2", 8, [*TP2, *PP2, *ZERO2]),
    ]),
    "mtp": (tiny_options, ["--mtp-num-layers", "1"], [
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("pp2 x vpp2 x dp2, distopt, overlap", 4, [*VPP2, *DISTOPT, *OVERLAP]),
        ("cp2 x pp2 x dp2, zero3", 8, [*CP2, *PP2, *ZERO3]),
    ]),
    "moe": (tiny_moe_options, [], [
        ("ep2 x tp2+sp x pp2, distopt", 8, [*EP2, *TP2, *PP2, *DISTOPT]),
        ("ep2 x etp1 x tp2+sp x pp2 x vpp2", 8, [*EP2, "--expert-tensor-parallel-size", "1",
                                                 *TP2, *VPP2]),
        ("ep2 x cp2 x pp2", 8, [*EP2, *CP2, *PP2]),
        ("ep2 x tp2+sp, allgather dispatcher", 4, [*EP2, *TP2, "--moe-token-dispatcher-type",
                                                   "allgather"]),
        ("ep4 x dp4, zero3 (expert dp 1)", 4, [*EP4, *ZERO3]),
        ("ep4 x dp4, distopt, overlap", 4, [*EP4, *DISTOPT, *OVERLAP]),
    ]),
    "hybrid": (tiny_options, list(HYBRID_OPTIONS), [
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("cp2 x tp2+sp x dp2", 8, [*CP2, *TP2]),
    ]),
    "deepseek": (_small("tiny-deepseek-v3.yaml"), [], [
        ("tp2+sp x pp2 x ep2, distopt", 8, [*TP2, *PP2, *EP2, *DISTOPT]),
        ("cp2 x pp2 x ep2 x dp2", 8, [*CP2, *PP2, *EP2]),
        ("tp2+sp x ep2, zero3 (expert dp 1)", 4, [*TP2, *EP2, *ZERO3]),
    ]),
    # DeepSeek sparse attention choosing all 64 positions (a choice of fewer is discrete:
    # scores tying within the layouts' rounding choose differently, tests/test_train_dsa.py)
    "deepseek-v32": (_small("tiny-deepseek-v32.yaml"), ["--dsa-indexer-topk", "64"], [
        ("tp2+sp x pp2 x ep2, distopt", 8, [*TP2, *PP2, *EP2, *DISTOPT]),
        ("cp2 x pp2 x ep2 x dp2", 8, [*CP2, *PP2, *EP2]),
        ("tp2+sp x ep2, zero3 (expert dp 1)", 4, [*TP2, *EP2, *ZERO3]),
    ]),
    # packed conversations: each attends to itself alone, whatever the layout
    "sft": (_sft("tiny.yaml"), [], [
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("pp2 x vpp2 x dp2, zero2", 4, [*VPP2, *ZERO2]),
        ("zero3 x tp2+sp x dp2", 4, [*ZERO3, *TP2]),
    ]),
    # two indexed corpora blended, documents marked by EOD: each attends to itself alone
    "blend": (_blend("tiny.yaml"), ["--reset-attention-mask", "--reset-position-ids",
                                    "--eod-mask-loss"], [
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("pp2 x vpp2 x dp2, zero2", 4, [*VPP2, *ZERO2]),
        ("cp2 x dp2, zero3", 4, [*CP2, *ZERO3]),
    ]),
    # the global batch ramps up from 4 to 8 sequences over the first 8 samples (Megatron's
    # --rampup-batch-size needs --train-samples): iterations of 4, 4, 8 and 8 sequences
    "rampup": (tiny_options, ["--train-iters", "none", "--train-samples", "24",
                              "--rampup-batch-size", "4", "4", "8", "--lr-warmup-iters", "0",
                              "--lr-warmup-samples", "4"], [
        ("dp2", 2, []),
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("pp2 x vpp2 x dp2, zero2", 4, [*VPP2, *ZERO2]),
        ("cp2 x dp2, zero3", 4, [*CP2, *ZERO3]),
    ]),
    "sft-deepseek": (_sft("tiny-deepseek-v3.yaml"), [], [
        ("tp2+sp x pp2 x ep2", 8, [*TP2, *PP2, *EP2]),
    ]),
    "sft-qwen3-next": (_sft("tiny-qwen3-next.yaml"), [], [
        ("tp2+sp x pp2 x dp2", 8, [*TP2, *PP2]),
    ]),
    "qwen3-next": (_small("tiny-qwen3-next.yaml"), [], [
        ("tp2+sp x pp2 x dp2, distopt", 8, [*TP2, *PP2, *DISTOPT]),
        ("cp2 x ep2, zero3", 4, [*CP2, *EP2, *ZERO3]),
    ]),
}  # fmt: skip


def _curve(group: str, ranks: int, argv: list[str], run_dir: Path) -> list[tuple]:
    """Trains argv on `ranks` ranks: each iteration's (loss, gradient norm), then each
    evaluation's (validation or test loss,) as the last rank printed it."""
    outputs = run_on_ranks(train_output_on_rank, ranks, argv, timeout=900)
    for rank, (status, printed) in enumerate(outputs):
        if status != 0:
            raise RuntimeError(f"{group}: rank {rank} exited with {status}: {printed[-300:]}")
    evaluated = r"(?:validation[^\n]*|test at iteration \d+) \| lm loss ([-+.e0-9]+)"
    validation = re.findall(evaluated, outputs[-1][1])
    curve = [(r["lm loss"], r["grad_norm"]) for r in metrics_records(run_dir)]
    return curve + [(float(loss),) for loss in validation]


def _difference(got: list[tuple], want: list[tuple]) -> float:
    if len(got) != len(want):
        return float("inf")
    pairs = zip(got, want, strict=True)
    return max(abs(a - b) / abs(b) for g, w in pairs for a, b in zip(g, w, strict=True))


def _resumed(group: str, options, own: list[str], ranks: int, flags: list[str], want: list,
             run_dir: Path) -> float:  # fmt: skip
    """Resumes across the layout both ways, against the one-rank run's last two iterations
    and its evaluations from the second on: trained 2 iterations at the layout, saved and
    resumed on one rank; then the one-rank run's iteration-2 checkpoint (in the folder
    "one" beside run_dir) resumed at the layout. The larger difference of the two."""
    saved, on_one, at_layout = (
        run_dir.with_name(f"{run_dir.name}-{part}") for part in ("saved", "on-one", "at-layout")
    )
    _curve(group, ranks, options(saved, *RESUME_RUN, *own, *flags, "--save", str(saved / "ckpt"),
                                 "--exit-interval", "2"), saved)  # fmt: skip
    tail = want[2:4] + want[5:]
    got = _curve(group, 1, options(on_one, *RESUME_RUN, *own, "--load", str(saved / "ckpt")),
                 on_one)  # fmt: skip
    worst = _difference(got, tail)
    checkpoint = run_dir.parent / "one" / "ckpt"
    got = _curve(group, ranks, options(at_layout, *RESUME_RUN, *own, *flags, "--load",
                                       str(checkpoint), "--ckpt-step", "2"), at_layout)  # fmt: skip
    return max(worst, _difference(got, tail))


def _resumed_here(group: str, options, own: list[str], ranks: int, flags: list[str],
                  run_dir: Path) -> float:  # fmt: skip
    """A layout's own 4 iterations (saved at 2 and 4) against its save of iteration 2
    resumed at the layout: iterations 3 and 4 and the evaluations from the second on."""
    whole = _curve(group, ranks, options(run_dir, *RESUME_RUN, *own, *flags, "--save",
                                         str(run_dir / "ckpt")), run_dir)  # fmt: skip
    again = run_dir.with_name(f"{run_dir.name}-resumed")
    saved = ["--load", str(run_dir / "ckpt"), "--ckpt-step", "2"]
    got = _curve(group, ranks, options(again, *RESUME_RUN, *own, *flags, *saved), again)
    return _difference(got, whole[2:4] + whole[5:])


EXPORT_TOLERANCE = 1e-4
"""--export: the largest relative difference (a tensor's norm) between a layout's export and
one rank's. Weights agree less closely than the curves: Adam's first steps divide each
gradient by its own magnitude, so an element whose gradient is a sum that nearly cancels
moves by what its rounding decides (7e-5 measured: Qwen3-Next's in_proj_ba at TP2 x PP2,
whose export is the one-rank export of the same checkpoint bit for bit). A piece placed
wrong, scaled or summed twice differs by far more."""

EXPORT_FLAGS = {
    # transformers' DeepSeek-V3 ranks an expert group by its 2 best scores, mp's router by
    # topk // group_topk: 4 of 8 experts from 2 of 4 groups
    "deepseek": ["--moe-router-topk", "4", "--norm-epsilon", "1e-6"],
    "sft-deepseek": ["--moe-router-topk", "4", "--norm-epsilon", "1e-6"],
    "deepseek-v32": ["--moe-router-topk", "4", "--norm-epsilon", "1e-6"],
    # transformers' Nemotron-H computes squared-ReLU MLPs
    "hybrid": ["--squared-relu", "--position-embedding-type", "none"],
}
"""--export: each group's flags that make its model one transformers has."""

NOT_EXPORTED = {"mtp": "transformers' Llama has no multi-token prediction layers"}


def _export(run_dir: Path) -> list[str]:
    """A run's export for transformers at the end (run_dir/hf)."""
    return ["--export-hf-dir", str(run_dir / "hf")]


def _exported_offline(run_dir: Path) -> None:
    """The run's final checkpoint exported by mp-ckpt alone (reading the layout's shards
    from disk) must be its export at the end of training, bit for bit."""
    offline = run_dir / "hf-offline"
    export_hf(run_dir / "ckpt", offline)
    if _exported_difference(offline, run_dir / "hf") != 0.0:
        raise ValueError("export: mp-ckpt export-hf of the final checkpoint differs from "
                         "the run's own export")  # fmt: skip


def _exported_difference(got: Path, want: Path) -> float:
    """The largest relative difference (a tensor's norm) between two Hugging Face
    directories that must hold the same tensors: the same files, config.json equal, the
    same tensor names, shapes and dtypes, or ValueError naming what differs."""
    files = {p.name for p in got.iterdir()}, {p.name for p in want.iterdir()}
    if files[0] != files[1]:
        raise ValueError(f"export: files {sorted(files[0] ^ files[1])} in one directory only")
    if json.loads((got / "config.json").read_text()) != json.loads(
        (want / "config.json").read_text()
    ):
        raise ValueError("export: config.json differs")
    tensors = [_safetensors(folder) for folder in (got, want)]
    if tensors[0].keys() != tensors[1].keys():
        raise ValueError(f"export: tensors {sorted(tensors[0].keys() ^ tensors[1].keys())} "
                         "in one directory only")  # fmt: skip
    worst = 0.0
    for name, expected in tensors[1].items():
        tensor = tensors[0][name]
        if tensor.shape != expected.shape or tensor.dtype != expected.dtype:
            raise ValueError(f"export: {name} is {tensor.dtype} {list(tensor.shape)}, one "
                             f"rank's {expected.dtype} {list(expected.shape)}")  # fmt: skip
        scale = expected.double().norm().item() or 1.0
        worst = max(worst, (tensor.double() - expected.double()).norm().item() / scale)
    return worst


def _safetensors(folder: Path) -> dict:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    if not found:
        raise ValueError(f"export: no safetensors in {folder}")
    return found


def sweep(groups: list[str], folder: Path, extra: list[str] = (), tolerance: float = TOLERANCE,
          mode: str = "curve", layout_extra: list[str] = ()) -> tuple[int, int]:  # fmt: skip
    """Runs each group's layouts (with `extra` flags in every run, `layout_extra` in the
    layouts' runs only); how many differ or
    failed (a group whose one-rank run fails counting all its layouts), and how many
    ran. mode "curve" compares each layout's curve with one rank's; "export" that too
    and, each run exporting its model for transformers at the end, each layout's export
    with one rank's (_exported_difference); "resume" resumes each layout's checkpoint on
    one rank and one rank's at the layout (_resumed); "here" resumes each layout's
    checkpoint at the layout (_resumed_here)."""
    failed = ran = 0
    for group in groups:
        options, own, layouts = GROUPS[group]
        own = [*own, *extra]
        if mode == "export":
            if group in NOT_EXPORTED:
                print(f"{group:14} skipped: {NOT_EXPORTED[group]}", flush=True)
                continue
            own = [*own, *EXPORT_FLAGS.get(group, [])]
        ran += len(layouts)
        one = folder / group / "one"
        reference = {"resume": [*RESUME_RUN, "--save", str(one / "ckpt")],
                     "export": [*RUN, *_export(one)]}.get(mode, RUN)  # fmt: skip
        try:
            want = None if mode == "here" else _curve(group, 1, options(one, *reference, *own),
                                                      one)  # fmt: skip
        except Exception as error:  # refused or failed at one rank: no reference to compare
            detail = str(error).strip().splitlines()[-1][:300]
            print(f"{group:14} {'one rank':48} 1 ranks          FAILED  {detail}", flush=True)
            failed += len(layouts)
            continue
        for index, (layout, ranks, flags) in enumerate(layouts):
            flags = [*flags, *layout_extra]
            run_dir = folder / group / str(index)
            start = time.monotonic()
            try:
                exported = None
                if mode == "resume":
                    worst = _resumed(group, options, own, ranks, flags, want, run_dir)
                elif mode == "here":
                    worst = _resumed_here(group, options, own, ranks, flags, run_dir)
                elif mode == "export":
                    saved = ["--save", str(run_dir / "ckpt")]  # the final save, for mp-ckpt
                    argv = options(run_dir, *RUN, *own, *flags, *_export(run_dir), *saved)
                    worst = _difference(_curve(group, ranks, argv, run_dir), want)
                    exported = _exported_difference(run_dir / "hf", one / "hf")
                    _exported_offline(run_dir)
                else:
                    got = _curve(group, ranks, options(run_dir, *RUN, *own, *flags), run_dir)
                    worst = _difference(got, want)
                same = worst <= tolerance and (exported is None or exported <= EXPORT_TOLERANCE)
                verdict = "ok" if same else "DIFFERS"
                detail = f"largest difference {worst:.1e}"
                if exported is not None:
                    detail += f", export {exported:.1e}"
            except Exception as error:  # a refusal or a failed rank: reported, the sweep goes on
                verdict, detail = "FAILED", str(error).strip().splitlines()[-1][:300]
            failed += verdict != "ok"
            seconds = time.monotonic() - start
            print(f"{group:14} {layout:48} {ranks} ranks {seconds:5.1f} s  {verdict:7} {detail}",
                  flush=True)  # fmt: skip
    return failed, ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "groups",
        nargs="*",
        metavar="GROUP",
        help=f"the groups to run (default: all): {', '.join(GROUPS)}",
    )
    parser.add_argument("--list", action="store_true", help="print the layouts and stop")
    parser.add_argument(
        "--with", dest="extra", default="", metavar="FLAGS",
        help="flags added to every run, one string (shell words)",
    )  # fmt: skip
    parser.add_argument(
        "--with-layouts", dest="layout_extra", default="", metavar="FLAGS",
        help="flags added to the layouts' runs only, not the one-rank ones (shell words)",
    )  # fmt: skip
    parser.add_argument(
        "--tolerance", type=float, default=TOLERANCE,
        help=f"the largest relative difference that passes ({TOLERANCE:g})",
    )  # fmt: skip
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume", dest="mode", action="store_const", const="resume", default="curve",
        help="resume each layout's checkpoint on one rank and one rank's at the layout",
    )  # fmt: skip
    resume.add_argument(
        "--export", dest="mode", action="store_const", const="export",
        help="each run also exports its model for transformers: compare the exports too",
    )  # fmt: skip
    resume.add_argument(
        "--resume-here", dest="mode", action="store_const", const="here",
        help="resume each layout's checkpoint at the layout, against its own run",
    )  # fmt: skip
    args = parser.parse_args(argv)
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group {', '.join(unknown)}: choose from {', '.join(GROUPS)}")
    groups = args.groups or list(GROUPS)
    if args.list:
        for group in groups:
            for layout, ranks, _ in GROUPS[group][2]:
                print(f"{group:14} {layout:48} {ranks} ranks")
        return 0
    with TemporaryDirectory(prefix="mp-sweep-") as folder:
        failed, ran = sweep(groups, Path(folder), shlex.split(args.extra), args.tolerance,
                            args.mode, shlex.split(args.layout_extra))  # fmt: skip
    print(f"{failed} of {ran} layouts differ or failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
