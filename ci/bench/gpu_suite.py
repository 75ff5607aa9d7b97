"""The GPU suite: one command for a machine with one GPU that checks mp on CUDA and
measures it beside transformers, printing one table and writing JSON.

    python3 ci/bench/gpu_suite.py [--out gpu_suite.json]
                                  [--steps smoke cuda-tests train generate packed profile]
                                  [--shapes SHAPE ...] [--variants VARIANT ...]
    python3 ci/bench/gpu_suite.py --cpu-smoke   # the same steps on the CPU, tiny shapes

Without --steps it runs smoke, cuda-tests, train and generate (packed and profile are
asked for by name); without --variants it trains bf16, compile-fused and
fp8-compile-fused (see Variants).

It needs the repository and a Python with torch and transformers (numpy, tokenizers,
safetensors, pyyaml and tqdm come with transformers), pytest for the CUDA tests and
torchao for the fp8 variant; no
uv and no install of mp: the suite puts packages/*/src, apps/gpt/src and ci/bench on
sys.path, and on PYTHONPATH for the processes it starts. mp-data's index builders are a
native extension, which the mock data of every step needs. Build it once into .site
(this needs scikit-build-core, pybind11, CMake and a C++17 compiler):

    python3 -m pip install --no-deps --no-build-isolation --target .site ./packages/mp-data

.site/mp_data then comes first on the path; the suite refuses to start while its Python
files differ from packages/mp-data/src (mp-data changed since: run the command again).
In a `uv sync` checkout the installed mp-data serves and .site is not needed.

Each step runs in a process of its own with a timeout: spawned on a GPU (a fresh CUDA
state per step), forked from a process that imported everything once with --cpu-smoke
(importing torch, mp and transformers anew takes 10 s and more on 2 loaded cores). A
step that fails or times out is reported with the end of its log; the others still run.
The steps, on the device mp_state picks (MP_DEVICE=cuda here, cpu with --cpu-smoke):

  smoke          apps/gpt's loop (tiny.yaml, mock data, bf16; fp32 on the CPU) trains 3
                 iterations and saves, resumes from the checkpoint to 5, and
                 mp_gpt.generate's Generator continues a prompt by 16 greedy tokens
  cuda-tests     `pytest -m cuda` on the test files that carry the marker (docs/testing.md);
                 skipped without a GPU or without pytest
  train S        shape S: ours (bench_gpt.run_ours, the real training loop) in each
                 variant V beside the plain transformers loop (bench_gpt.run_hf), in
                 alternating rounds of one process: each round runs every variant, then
                 the transformers loop once. A row for the step (the transformers loop's
                 figures) and one per variant, `train S V`: tokens/s (best timed
                 iteration), MFU, the seconds of its runs and of building its model and
                 optimizer (the loop's model-and-optimizer-setup timer)
  generate S     bench_generate.compare in bf16 at each batch size: ms per new token and
                 prefill tokens/s, ours (KV cache) beside transformers' generate
  profile S V    shape S, variant V (any of VARIANTS; --variants chooses them as for
                 train, FP8 included): ours trains warm-up + 2 iterations
                 with mp's --profile on the one after the warm-up; the share of that
                 iteration each kind of GPU kernel took and the 20 kernels with the most
                 time (kernel_time.py; on the CPU, top-level operators)
  packed         core attention over 27 packed documents in 8192 positions (bf16, forward
                 and backward): one variable-length flash call beside one document at a
                 time and beside the dense mask (gpu_steps.packed)

Shapes (sequence, micro-batch = global batch):

  llama-3.2-1b       Llama-3.2-1B: 16 layers x 2048, GQA 32/8 (head 64), ffn 8192, vocabulary
                     128,256, tied embeddings; 4096, 2 (a shape: random weights, RoPE theta
                     10,000)
  llama-3-8b-layers  4 of Llama-3-8B's 32 layers: 4096 wide, GQA 32/8 (head 128), ffn
                     14,336, vocabulary 128,256, untied; 8192, 1

Variants of each training step: a name and the flags added to ours (the baseline stays
the plain bf16 loop): bf16 (none), fp8 (--fp8-format hybrid), torch-compile,
fp8-compile, compile-fused (--torch-compile --cross-entropy-loss-fusion
--torch-compile-optimizer: mp's fastest bf16 path) and fp8-compile-fused (that with
--fp8-format hybrid). A variant that pretrain_gpt.py would refuse here (mp_train.load_config:
an unknown flag, or one this machine cannot run, such as FP8 without FP8 tensor cores or
without torchao) is not run: its row says "refused" and gives that one line, so that the
variant runs once its flag lands and the machine has what it needs. With --cpu-smoke only
bf16 runs; the others are only checked.

MFU: Megatron's FLOPs per iteration (mp_train.estimate) over the GPU's dense bf16 peak
(mp_train.observability.metrics.known_peak_tflops: 989 TFLOP/s for an H100), or over a measured bf16
matmul for a GPU not in that table (and on the CPU).

Measured on one H100 (2026-11-27, docs/benchmarks.md): about 9.5 minutes (smoke 35 s,
CUDA tests 55 s, each training step 35-75 s, generation 95 s), more than one 10-minute
device command holds with the build of .site: run `--steps smoke cuda-tests train`, then
`--steps generate`. On one H200 (2026-12-04): CUDA tests 47 s, each training step
37-67 s (fp8-compile the longest), packed 16 s, each profile step 25-35 s: `--steps
cuda-tests train --variants bf16 torch-compile fp8-compile` took 381 s, `--steps packed
profile` 139 s; later, `--steps train --variants bf16 compile-fused fp8-compile-fused`
420 s with a process per variant (bf16 53-55 s, the compiled ones 74-78 s), and `--steps
train --shapes llama-3.2-1b` 149 s with the three in one step (207 s as three steps):
each of our runs took 13.5-25.2 s (40.3 s for the first compiled one), of which its 5
iterations are under 1 s, against 1.1 s for transformers' run: our start-up, which each
row now splits off (the model-and-optimizer-setup seconds). Each step's line is printed, and
the JSON report rewritten, as the step ends, so that a suite stopped from outside (a
device command's time limit) still leaves what it finished. --cpu-smoke took 17 to 43 s
(11 to 13 s of CPU) on the 2-core CI machine, busy with other tests.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]
SITE = REPO / ".site"
BUILD_NATIVE = (
    "python3 -m pip install --no-deps --no-build-isolation --target .site ./packages/mp-data"
)

VARIANTS = (
    ("bf16", ()),
    ("fp8", ("--fp8-format", "hybrid")),
    ("torch-compile", ("--torch-compile",)),
    ("fp8-compile", ("--fp8-format", "hybrid", "--torch-compile")),
    (
        "compile-fused",
        ("--torch-compile", "--cross-entropy-loss-fusion", "--torch-compile-optimizer"),
    ),
    (
        "fp8-compile-fused",
        (
            "--fp8-format",
            "hybrid",
            "--torch-compile",
            "--cross-entropy-loss-fusion",
            "--torch-compile-optimizer",
        ),
    ),
)
"""Training variants: name, the flags ours runs with (on top of bench_gpt.config_argv)."""

DEFAULT_VARIANTS = ("bf16", "compile-fused", "fp8-compile-fused")
"""What a run without --variants trains: eager bf16, mp's fastest bf16 path, and FP8 on it."""

STEPS = ("smoke", "cuda-tests", "train", "generate", "packed", "profile")
DEFAULT_STEPS = ("smoke", "cuda-tests", "train", "generate")
"""What a run without --steps runs; packed and profile are asked for by name."""

TIMEOUTS = {
    "smoke": 240,
    "cuda-tests": 480,
    "train": 120,
    "train per variant": 150,
    "generate": 300,
    "packed": 120,
    "profile": 240,
}
"""Seconds a step may take on a GPU (--cpu-smoke: a third)."""


def _put_sources_on_path() -> None:
    paths = [SITE] if (SITE / "mp_data").is_dir() else []
    paths += [*sorted(REPO.glob("packages/*/src")), REPO / "apps" / "gpt" / "src", BENCH]
    entries = [str(p) for p in paths]
    sys.path[:0] = [e for e in entries if e not in sys.path]
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*entries, *([inherited] if inherited else [])])


_put_sources_on_path()


@dataclass
class Row:
    """One line of the table: a step's outcome."""

    name: str
    status: str
    """ok, failed, timeout, skipped, refused, or checked (a variant --cpu-smoke only checks)."""
    seconds: float | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    log: str | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("gpu_suite.json"),
        help="the JSON report; the step logs go to a folder beside it (NAME.logs/)",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="tiny shapes on the CPU (the default without a CUDA device)",
    )  # fmt: skip
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(DEFAULT_STEPS),
                        help=f"the steps to run (default: {' '.join(DEFAULT_STEPS)})")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="the training shapes to run (default: all)")  # fmt: skip
    parser.add_argument("--variants", nargs="+", metavar="VARIANT",
                        choices=[name for name, _ in VARIANTS],
                        help="the variants to train and profile (default: "
                             f"{' '.join(DEFAULT_VARIANTS)})")  # fmt: skip
    args = parser.parse_args(argv)
    problem = _mp_data_problem()
    if problem:
        print(f"gpu_suite: {problem}", file=sys.stderr)
        return 2

    import torch

    cuda = not args.cpu_smoke and torch.cuda.is_available()
    mode = "cuda" if cuda else "cpu-smoke" if args.cpu_smoke else "cpu-smoke (no CUDA device)"
    sizes = "cuda" if cuda else "cpu-smoke"
    os.environ["MP_DEVICE"] = "cuda" if cuda else "cpu"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gpu_steps

    if not cuda:
        gpu_steps.preload()
    logs = args.out.with_suffix("").with_name(args.out.stem + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = _Rows(args.out, mode, start)
    run = _Runner(logs, "spawn" if cuda else "fork", 1.0 if cuda else 1 / 3)
    if "smoke" in args.steps:
        rows.append(run("smoke", "smoke", {"mode": sizes}, TIMEOUTS["smoke"]))
    if "cuda-tests" in args.steps:
        if cuda:
            timeout = TIMEOUTS["cuda-tests"]
            rows.append(run("cuda-tests", "cuda_tests", {"timeout": timeout - 30}, timeout))
        else:
            rows.append(Row("cuda-tests", "skipped", reason="no CUDA device"))
    if "train" in args.steps:
        for shape_name in _chosen(gpu_steps.SIZES[sizes].shapes, args.shapes):
            runnable, not_run = [], []
            for variant, flags in VARIANTS:
                if variant not in (args.variants or DEFAULT_VARIANTS):
                    continue
                name = f"train {shape_name} {variant}"
                refused = gpu_steps.refusal(sizes, shape_name, list(flags))
                if refused:
                    not_run.append(Row(name, "refused", reason=refused))
                elif flags and not cuda:
                    not_run.append(Row(name, "checked", reason="accepted; not run on the CPU"))
                else:
                    runnable.append([variant, list(flags)])
            if runnable:
                kwargs = {"mode": sizes, "shape_name": shape_name, "variants": runnable}
                timeout = TIMEOUTS["train"] + TIMEOUTS["train per variant"] * len(runnable)
                step = run(f"train {shape_name}", "train", kwargs, timeout)
                for row in _variant_rows(step, runnable):
                    rows.append(row)
            for row in not_run:
                rows.append(row)
    if "generate" in args.steps:
        shape_name = gpu_steps.SIZES[sizes].generate_shape
        rows.append(run(f"generate {shape_name}", "generate", {"mode": sizes},
                        TIMEOUTS["generate"]))  # fmt: skip
    if "packed" in args.steps:
        rows.append(run("packed", "packed", {"mode": sizes}, TIMEOUTS["packed"]))
    if "profile" in args.steps:
        for shape_name in _chosen(gpu_steps.SIZES[sizes].shapes, args.shapes):
            for variant, flags in VARIANTS:
                if variant not in (args.variants or DEFAULT_VARIANTS):
                    continue
                name = f"profile {shape_name} {variant}"
                refused = gpu_steps.refusal(sizes, shape_name, list(flags))
                if refused:
                    rows.append(Row(name, "refused", reason=refused))
                    continue
                if flags and not cuda:
                    rows.append(Row(name, "checked", reason="accepted; not run on the CPU"))
                    continue
                kwargs = {"mode": sizes, "shape_name": shape_name, "flags": list(flags)}
                rows.append(run(name, "profile", kwargs, TIMEOUTS["profile"]))
    total = rows.write()
    print(table(rows, mode, total))
    print(f"report: {args.out}; step logs: {logs}/")
    return 1 if any(r.status in ("failed", "timeout") for r in rows) else 0


class _Rows(list):
    """The rows so far; each one appended is printed as its table line and the JSON
    report rewritten (under a temporary name, then renamed), so that a suite stopped
    from outside still leaves every finished step."""

    def __init__(self, out: Path, mode: str, start: float) -> None:
        super().__init__()
        self.out, self.mode, self.start = out, mode, start

    def append(self, row: Row) -> None:
        super().append(row)
        print(table([row], self.mode, time.perf_counter() - self.start).splitlines()[3],
              flush=True)  # fmt: skip
        self.write()

    def write(self) -> float:
        """Writes the report; returns the seconds since the suite started."""
        from harness import context

        total = time.perf_counter() - self.start
        report = {"suite": "gpu_suite", "mode": self.mode, "total_s": round(total, 1),
                  "steps": [asdict(r) for r in self], **context()}  # fmt: skip
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(report, indent=1) + "\n")
        partial.replace(self.out)
        return total


def _variant_rows(step: Row, variants: list[list]) -> list[Row]:
    """The rows of one shape's training step: the step's own (the transformers loop's
    figures and the whole step's seconds), then one per variant (ours beside it, the
    seconds its own runs took)."""
    if step.status != "ok":
        return [step] + [Row(f"{step.name} {name}", step.status, reason=f"in {step.name}",
                             log=step.log) for name, _ in variants]  # fmt: skip
    shared = {k: v for k, v in step.figures.items() if k not in ("variants", "hf")}
    hf = step.figures["hf"]
    rows = [Row(step.name, "ok", step.seconds, {**shared, "transformers": hf,
                                                "variants": [n for n, _ in variants]},
                log=step.log)]  # fmt: skip
    for name, _ in variants:
        figures = {**shared, **step.figures["variants"][name]}
        rows.append(Row(f"{step.name} {name}", "ok", round(sum(figures["run_s"]), 1), figures,
                        log=step.log))  # fmt: skip
    return rows


def _chosen(names, wanted: list[str] | None) -> list[str]:
    if wanted:
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"gpu_suite: unknown shape {unknown[0]}: one of {', '.join(names)}")
    return [n for n in names if not wanted or n in wanted]


class _Runner:
    """Runs a step of gpu_steps in a process of its own, with a timeout."""

    def __init__(self, logs: Path, method: str, timeout_scale: float) -> None:
        self.logs, self.scale = logs, timeout_scale
        self.context = multiprocessing.get_context(method)

    def __call__(self, name: str, function: str, kwargs: dict, timeout: float) -> Row:
        import gpu_steps

        slug = re.sub(r"[^a-z0-9.]+", "-", name.lower())
        result, log = self.logs / f"{slug}.json", self.logs / f"{slug}.log"
        result.unlink(missing_ok=True)
        timeout *= self.scale
        process = self.context.Process(target=gpu_steps.run_step, name=f"gpu-suite {name}",
                                       args=(function, kwargs, str(result), str(log)))  # fmt: skip
        start = time.perf_counter()
        process.start()
        process.join(timeout)
        seconds = round(time.perf_counter() - start, 1)
        if process.is_alive():
            process.kill()
            process.join()
            return Row(name, "timeout", seconds, reason=f"still running after {timeout:.0f} s: "
                       f"{_last_line(log)}", log=str(log))  # fmt: skip
        if not result.exists():
            return Row(name, "failed", seconds, log=str(log), reason=f"exited with "
                       f"{process.exitcode} and no result: {_last_line(log)}")  # fmt: skip
        outcome = json.loads(result.read_text())
        return Row(name, outcome["status"], seconds, outcome.get("figures", {}),
                   outcome.get("reason", ""), str(log))  # fmt: skip


def table(rows: list[Row], mode: str, total: float) -> str:
    """The rows as a text table: step, status, seconds, what it found."""
    device = next((r.figures["device"] for r in rows if "device" in r.figures), "?")
    lines = [f"gpu_suite ({mode}) on {device}", ""]
    width = max(len(r.name) for r in rows) if rows else 4
    lines.append(f"{'step':<{width}}  {'status':<8}  {'s':>6}  result")
    for r in rows:
        seconds = f"{r.seconds:6.1f}" if r.seconds is not None else "     -"
        text = _summary(r) if r.status == "ok" else r.reason
        lines.append(f"{r.name:<{width}}  {r.status:<8}  {seconds}  {text}")
    lines.append(f"{'total':<{width}}  {'':<8}  {total:6.1f}")
    return "\n".join(lines)


def _summary(row: Row) -> str:
    f = row.figures
    if row.name == "smoke":
        losses = f["losses"]
        return (f"{f['precision']}: iterations 1-3, saved, resumed 4-5; loss {losses[0]:.3f} -> "
                f"{losses[-1]:.3f}; {len(f['generated'])} tokens generated")  # fmt: skip
    if row.name == "cuda-tests":
        return f["summary"]
    if row.name.startswith("train ") and "transformers" in f:
        hf = f["transformers"]
        rounds = f"{f['rounds']} round{'s' if f['rounds'] > 1 else ''}"
        return (f"transformers {hf['tokens_per_s']:,.0f} tok/s, MFU {hf['mfu']:.2f}, beside "
                f"{', '.join(f['variants'])}, alternating, {rounds}; its runs "
                f"{' + '.join(f'{t:.1f}' for t in hf['run_s'])} s")  # fmt: skip
    if row.name.startswith("train "):
        return (f"ours {f['tokens_per_s']:,.0f} tok/s, MFU {f['mfu']:.2f}; transformers "
                f"{f['hf_tokens_per_s']:,.0f} tok/s, MFU {f['hf_mfu']:.2f}; ours "
                f"{f['ratio_to_hf']:.2f}x its tokens/s; its runs "
                f"{' + '.join(f'{t:.1f}' for t in f['run_s'])} s, of which building the "
                f"model and optimizer {' + '.join(f'{t:.1f}' for t in f['setup_s'])}")  # fmt: skip
    if row.name.startswith("generate "):
        parts = [f"{key}: ours {g['ms_per_token']:.2f} ms/token, transformers "
                 f"{g['hf_ms_per_token']:.2f} (ours {g['ratio_to_hf']:.2f}x its time)"
                 for key, g in f.items() if re.fullmatch(r"b\d+", key)]  # fmt: skip
        return "; ".join(parts)
    if row.name.startswith("profile "):
        shares = ", ".join(f"{k} {v:.0%}" for k, v in f["share_of_iteration"].items() if v >= 0.005)
        return f"iteration {f['iteration_ms']:.1f} ms: {shares}"
    if row.name == "packed":
        kernel = "varlen kernel" if f["varlen_kernel"] else "no varlen kernel"
        return (f"{f['documents']} documents in {f['seq']}, {kernel}: {f['packed_ms']:.1f} ms; "
                f"{f['speedup_over_per_document']:.2f}x one document at a time, "
                f"{f['speedup_over_dense_mask']:.2f}x the dense mask; outputs within "
                f"{f['max_difference']:.1e}")  # fmt: skip
    return ""


def _mp_data_problem() -> str | None:
    """Why mp_data cannot serve the steps (a stale .site copy, no native extension), or
    None."""
    import importlib.util

    source = REPO / "packages" / "mp-data" / "src" / "mp_data"
    if (SITE / "mp_data").is_dir():
        copy = SITE / "mp_data"
        stale = [p.relative_to(source) for p in sorted(source.rglob("*.py"))
                 if not _same_bytes(p, copy / p.relative_to(source))]  # fmt: skip
        if stale:
            return (f".site/mp_data differs from packages/mp-data/src ({stale[0]}): build it "
                    f"again: rm -rf .site && {BUILD_NATIVE}")  # fmt: skip
    if importlib.util.find_spec("mp_data._native") is None:
        return f"mp-data's native extension is not built: {BUILD_NATIVE}"
    return None


def _same_bytes(a: Path, b: Path) -> bool:
    return b.is_file() and a.read_bytes() == b.read_bytes()


def _last_line(log: Path) -> str:
    lines = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
    return lines[-1][:300] if lines else "(no output)"


if __name__ == "__main__":
    sys.exit(main())
