"""The steps of gpu_suite.py, and the process each runs in (run_step).

A step is a function of plain arguments that returns its figures (a JSON-able dict),
raises Skipped with the reason it cannot run here, or fails with an exception. It runs
on the device mp_state picks (gpu_suite.py sets MP_DEVICE for the suite's processes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import LlamaShape
from kernel_time import kernel_time

REPO = Path(__file__).resolve().parents[2]

__all__ = ["SIZES", "Sizes", "Skipped", "preload", "refusal", "run_step"]


@dataclass(frozen=True)
class Sizes:
    """How big each step is: the CUDA suite's, or --cpu-smoke's tiny ones."""

    shapes: dict[str, tuple[LlamaShape, int, int]]
    """Training shapes by name: (shape, sequence length, micro-batch = global batch)."""
    smoke_precision: tuple[str, ...]
    rounds: int
    warmup: int
    iters: int
    generate_shape: str
    generate_batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    generate_rounds: int


SIZES = {
    "cuda": Sizes(
        shapes={
            "llama-3.2-1b": (LlamaShape(2048, 16, 32, 8, 64, 8192, 128256, tied=True), 4096, 2),
            "llama-3-8b-layers": (LlamaShape(4096, 4, 32, 8, 128, 14336, 128256), 8192, 1),
        },
        smoke_precision=("--bf16",),
        rounds=2,
        warmup=2,
        iters=3,
        generate_shape="llama-3.2-1b",
        generate_batches=(1, 8),
        prompt_len=128,
        new_tokens=128,
        generate_rounds=2,
    ),
    # The smoke run trains in fp32 on the CPU: bf16 took 6x as long on the 2-core CI
    # machine (3.2 s against 0.5 s).
    "cpu-smoke": Sizes(
        shapes={
            "llama-3.2-1b": (LlamaShape(64, 2, 4, 2, 16, 128, 1000, tied=True), 32, 2),
            "llama-3-8b-layers": (LlamaShape(64, 1, 4, 2, 16, 224, 1000), 64, 1),
        },
        smoke_precision=(),
        rounds=1,
        warmup=1,
        iters=1,
        generate_shape="llama-3.2-1b",
        generate_batches=(1, 2),
        prompt_len=8,
        new_tokens=16,
        generate_rounds=1,
    ),
}


class Skipped(Exception):
    """The step cannot run here; the message says why."""


def run_step(function: str, kwargs: dict, result_path: str, log_path: str) -> None:
    """The body of a step's process: output to log_path, the outcome (status, figures or
    reason) to result_path as JSON."""
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if os.environ.get("MP_DEVICE") == "cpu":
        import torch

        torch.set_num_threads(1)  # a forked child must not use the parent's thread pool
    try:
        outcome = {"status": "ok", "figures": _STEPS[function](**kwargs)}
    except Skipped as why:
        outcome = {"status": "skipped", "reason": str(why)}
    except BaseException as error:
        traceback.print_exc()
        outcome = {"status": "failed", "reason": _one_line(f"{type(error).__name__}: {error}")}
    Path(result_path).write_text(json.dumps(outcome))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a forked step skips its parent's exit handlers


def preload() -> None:
    """Imports what the steps use, so that steps forked from this process start at once."""
    import bench_generate  # noqa: F401
    import bench_gpt  # noqa: F401
    import transformers

    import mp_gpt.generate
    import mp_gpt.testing  # noqa: F401

    transformers.LlamaForCausalLM  # noqa: B018 (transformers imports its models lazily)


def refusal(mode: str, shape_name: str, flags: list[str]) -> str | None:
    """The one line with which pretrain_gpt.py would refuse a training step's flags here
    (mp_train.load_config: the parser, validation, and whether this machine can run them,
    e.g. FP8 needs FP8 tensor cores and torchao), or None."""
    from bench_gpt import config_argv

    from mp_train import load_config

    shape, seq, batch = SIZES[mode].shapes[shape_name]
    try:
        load_config([*config_argv(shape, seq, batch, 2, 1.0), *flags])
    except ValueError as error:  # ConfigError, named flags and the fix
        return _one_line(str(error))
    return None


# The steps.


def smoke(mode: str) -> dict[str, Any]:
    """apps/gpt's loop trains tiny.yaml on mock data 3 iterations and saves (exit at 3 of
    5), resumes from that checkpoint to 5, and the Generator continues a prompt by 16
    greedy tokens from the checkpoint."""
    import torch

    import mp_state
    from mp_gpt.generate import Generator
    from mp_gpt.generation import Sampling
    from mp_gpt.pretrain import main as pretrain
    from mp_gpt.testing import metrics_records, tiny_options

    with tempfile.TemporaryDirectory() as scratch:
        run = Path(scratch)
        os.environ.setdefault("MP_RUN_DIR", scratch)
        checkpoints = str(run / "checkpoints")
        options = tiny_options(run, *SIZES[mode].smoke_precision, "--save", checkpoints,
                               "--load", checkpoints, "--train-iters", "5")  # fmt: skip
        for extra in (["--exit-interval", "3"], []):
            code = pretrain([*options, *extra])
            if code != 0:
                raise RuntimeError(f"pretrain_gpt {' '.join(extra)} exited with {code}")
        records = metrics_records(run)
        iterations = [r["iteration"] for r in records]
        if iterations != [1, 2, 3, 4, 5]:
            raise RuntimeError(f"iterations {iterations}: expected 1..5, resumed after 3")
        losses = [r["lm loss"] for r in records]
        generator = Generator(checkpoints)
        try:
            done = generator.complete([[1, 2, 3]], max_new_tokens=16, sampling=[Sampling()])
        finally:
            generator.close()
        if len(done[0].tokens) != 16:
            raise RuntimeError(f"generated {len(done[0].tokens)} tokens, expected 16")
        device = mp_state.select_device().device
    return {
        "device": _device_name(device),
        "precision": "bf16" if SIZES[mode].smoke_precision else "fp32",
        "iterations": iterations,
        "losses": [round(x, 4) for x in losses],
        "losses_finite": all(math.isfinite(x) for x in losses),
        "generated": done[0].tokens,
        "torch": torch.__version__,
    }


def cuda_tests(timeout: float) -> dict[str, Any]:
    """pytest -m cuda on the test files that carry the marker, in a process of its own
    (the repository's pytest settings, without its -n options: pytest-xdist may be
    missing)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        raise Skipped("pytest is not installed")
    roots = [*REPO.glob("packages/*/tests"), *REPO.glob("apps/*/tests"), REPO / "tests"]
    files = sorted(str(p.relative_to(REPO)) for root in roots for p in root.rglob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())  # fmt: skip
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "--import-mode=importlib",
               "-p", "no:cacheprovider", "-q", "-rfEs", "-m", "cuda", *files]  # fmt: skip
    print(" ".join(command), flush=True)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(done.stdout, done.stderr, sep="\n", flush=True)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                     summary)}  # fmt: skip
    if done.returncode != 0 or counts.get("passed", 0) == 0:
        raise RuntimeError(f"pytest exited with {done.returncode}: {summary}")
    return {"summary": summary, **counts, "files": files}


def train(mode: str, shape_name: str, variants: list[list]) -> dict[str, Any]:
    """Ours (the real loop) with each variant's flags, [name, flags] in `variants`, and
    the plain transformers loop, in alternating rounds on one device: each round runs
    every variant in turn, then the transformers loop, each side built anew in its turn
    (two models would not fit next to each other on one GPU at the 8B layer shape). One
    transformers run per round serves every variant's comparison."""
    import bench_gpt
    import torch

    import mp_state
    from mp_train import estimate, load_config

    sizes = SIZES[mode]
    shape, seq, batch = sizes.shapes[shape_name]
    device = mp_state.select_device().device
    peak, peak_source = _peak_tflops(device)
    iterations = sizes.warmup + sizes.iters
    sides = [name for name, _ in variants] + ["hf"]
    times: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[list[float]]] = {side: [] for side in sides}
    walls: dict[str, list[float]] = {side: [] for side in sides}
    setups: dict[str, list[float]] = {name: [] for name, _ in variants}
    params, peak_gib = {}, dict.fromkeys(sides, 0.0)
    left_gib: dict[str, list[float]] = {name: [] for name, _ in variants}
    flops = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(sizes.rounds):
            for name, flags in variants:
                metrics = f"{scratch}/metrics-{name}-{round_}.jsonl"
                argv = bench_gpt.config_argv(shape, seq, batch, iterations, peak, metrics)
                config = load_config([*argv, *flags])
                estimated = estimate(config, 1, vocab_size=bench_gpt.padded_vocab(config))
                flops[name] = estimated["flops_per_iteration"]
                _reset_peak(device)
                start = time.perf_counter()
                (seconds, loss, _, params[name]), setup_ms = bench_gpt.run_ours_and_setup(config)
                walls[name].append(time.perf_counter() - start)
                setups[name].append(setup_ms / 1000)
                times[name] += seconds[sizes.warmup :]
                losses[name].append(loss)
                peak_gib[name] = max(peak_gib[name], _peak_gib(device))
                left_gib[name].append(_free(device))
            _reset_peak(device)
            start = time.perf_counter()
            seconds, loss, params["hf"] = bench_gpt.run_hf(config, shape, iterations, device)
            walls["hf"].append(time.perf_counter() - start)
            times["hf"] += seconds[sizes.warmup :]
            losses["hf"].append(loss)
            peak_gib["hf"] = max(peak_gib["hf"], _peak_gib(device))
            _free(device)
    tokens = seq * batch
    best = {side: min(t) for side, t in times.items()}
    median = {side: statistics.median(t) for side, t in times.items()}
    hf_flops = flops[variants[0][0]]  # the same model: the estimate does not see the flags
    hf = {
        "tokens_per_s": round(tokens / best["hf"], 1),
        "mfu": round(hf_flops / best["hf"] / (peak * 1e12), 3),
        "iteration_s": [round(t, 4) for t in times["hf"]],
        "losses": [[round(x, 3) for x in run] for run in losses["hf"]],
        "parameters": params["hf"], "peak_memory_gib": round(peak_gib["hf"], 2),
        "run_s": [round(t, 1) for t in walls["hf"]],
    }  # fmt: skip
    ours = {
        name: {
            "variant": name, "flags": list(flags),
            "tokens_per_s": round(tokens / best[name], 1),
            "hf_tokens_per_s": hf["tokens_per_s"],
            "ratio_to_hf": round(best["hf"] / best[name], 3),
            "ratio_to_hf_median": round(median["hf"] / median[name], 3),
            "mfu": round(flops[name] / best[name] / (peak * 1e12), 3),
            "hf_mfu": hf["mfu"],
            "flops_per_iteration": flops[name],
            "iteration_s": [round(t, 4) for t in times[name]],
            "hf_iteration_s": hf["iteration_s"],
            "losses": [[round(x, 3) for x in run] for run in losses[name]],
            "hf_losses": hf["losses"],
            "parameters": params[name], "hf_parameters": params["hf"],
            "peak_memory_gib": round(peak_gib[name], 2),
            "hf_peak_memory_gib": hf["peak_memory_gib"],
            "left_allocated_gib_after_ours": [round(x, 3) for x in left_gib[name]],
            "run_s": [round(t, 1) for t in walls[name]],
            "setup_s": [round(t, 1) for t in setups[name]],
        }
        for name, flags in variants
    }  # fmt: skip
    return {
        "device": _device_name(device), "variants": ours, "hf": hf,
        "peak_tflops": float(f"{peak:.3g}"), "peak_source": peak_source,
        "shape": asdict(shape), "sequence_length": seq, "batch": batch,
        "rounds": sizes.rounds, "warmup_per_run": sizes.warmup, "timed_per_run": sizes.iters,
        "torch": torch.__version__,
    }  # fmt: skip


def generate(mode: str) -> dict[str, Any]:
    """bench_generate's comparison in bf16 at each batch size: ours (mp_gpt's Generator,
    KV cache) beside transformers' generate on the same weights."""
    import bench_generate
    import torch

    import mp_state

    sizes = SIZES[mode]
    shape = sizes.shapes[sizes.generate_shape][0]
    device = mp_state.select_device().device
    args = argparse.Namespace(new_tokens=sizes.new_tokens, prompt_len=sizes.prompt_len,
                              rounds=sizes.generate_rounds)  # fmt: skip
    positions = sizes.prompt_len + sizes.new_tokens
    with tempfile.TemporaryDirectory() as scratch:
        pair = bench_generate.model_pair(shape, positions, Path(scratch), device, torch.bfloat16)
    ours, hf_model = pair
    try:
        ours.model.to(torch.bfloat16)
        figures = {f"b{b}": bench_generate.compare(ours.model, hf_model, b, args, shape)
                   for b in sizes.generate_batches}  # fmt: skip
    finally:
        ours.close()
    return {"device": _device_name(device), "shape_name": sizes.generate_shape,
            "dtype": "bf16", **figures}  # fmt: skip


PACKED = {"cuda": (8192, 27, 32, 8, 128, 5), "cpu-smoke": (256, 4, 4, 2, 16, 1)}
"""mode -> (sequence, documents, query heads, key/value heads, head width, timed calls) of
the packed step."""


def packed(mode: str) -> dict[str, Any]:
    """Core attention over one bf16 sample packing documents of random lengths (mean 300
    at 8192 positions), forward and backward, three ways taking turns: packed (one
    variable-length flash call where torch has it), packed one document at a time (the
    path without it), and the dense [1, 1, s, s] mask keeping the documents apart. The
    best time of each, and the largest difference of packed's output from the
    per-document one."""
    import time

    import numpy as np
    import torch

    import mp_state
    from mp_layers import PackedSeqParams
    from mp_layers.transformer import core_attention

    s, docs, nq, ng, d, calls = PACKED[mode]
    device = mp_state.select_device().device
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, s), docs - 1, replace=False))
    ids = torch.from_numpy(np.searchsorted(cuts, np.arange(s), side="right"))[None].to(device)
    packed_params = PackedSeqParams.from_document_ids(ids)
    allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril_()
    allowed &= ids[0][:, None] == ids[0][None, :]
    dense = (~allowed)[None, None]
    torch.manual_seed(0)
    q, k, v = (torch.randn(s, 1, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for n in (nq, ng, ng))  # fmt: skip
    grad = torch.randn(s, 1, nq * d, device=device, dtype=torch.bfloat16)
    attention = core_attention.CoreAttention(0.0, None, "flash")
    varlen = core_attention._varlen_fits(q, v)

    def one_by_one(*inputs):  # the path without the variable-length kernel
        fits, core_attention._varlen_fits = core_attention._varlen_fits, lambda *a: False
        try:
            return attention(*inputs, packed_params)
        finally:
            core_attention._varlen_fits = fits

    ways = {"packed": lambda *t: attention(*t, packed_params), "per_document": one_by_one,
            "dense_mask": lambda *t: attention(*t, dense)}  # fmt: skip
    outputs, times = {}, {name: [] for name in ways}
    for round_ in range(calls + 1):  # the first round warms up
        for name, way in ways.items():
            for t in (q, k, v):
                t.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = way(q, k, v)
            out.backward(grad)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_:
                times[name].append(time.perf_counter() - start)
            outputs[name] = out.detach().float()
    best = {name: min(t) * 1000 for name, t in times.items()}
    return {
        "device": _device_name(device), "seq": s, "documents": docs, "varlen_kernel": varlen,
        **{f"{name}_ms": round(ms, 3) for name, ms in best.items()},
        "speedup_over_per_document": round(best["per_document"] / best["packed"], 2),
        "speedup_over_dense_mask": round(best["dense_mask"] / best["packed"], 2),
        "max_difference": float((outputs["packed"] - outputs["per_document"]).abs().max()),
    }  # fmt: skip


def profile(mode: str, shape_name: str, flags: list[str]) -> dict[str, Any]:
    """Ours (the real loop with `flags`) trains warm-up + 2 iterations with mp's --profile
    on the one after the warm-up: where that iteration's time goes, by kind of kernel
    (GPU kernels on a GPU; top-level CPU operators on the CPU), and the kernels that took
    the most time."""
    import glob

    import bench_gpt

    import mp_state
    from mp_train import load_config

    sizes = SIZES[mode]
    shape, seq, batch = sizes.shapes[shape_name]
    device = mp_state.select_device().device
    profiled = sizes.warmup + 1
    with tempfile.TemporaryDirectory() as scratch:
        argv = bench_gpt.config_argv(shape, seq, batch, profiled + 1, 1.0, f"{scratch}/m.jsonl")
        argv += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(profiled),
                 "--profile-step-end", str(profiled + 1), "--tensorboard-dir", scratch]  # fmt: skip
        bench_gpt.run_ours(load_config([*argv, *flags]))
        traces = glob.glob(f"{scratch}/**/*.pt.trace.json", recursive=True)
        if len(traces) != 1:
            raise RuntimeError(f"expected one trace under {scratch}, found {traces}")
        events = json.loads(Path(traces[0]).read_text())["traceEvents"]
    figures = kernel_time(events, gpu=device.type == "cuda")
    return {"device": _device_name(device), "shape_name": shape_name, "flags": flags,
            "iteration": profiled, **figures}  # fmt: skip


_STEPS = {"smoke": smoke, "cuda_tests": cuda_tests, "train": train, "generate": generate,
          "packed": packed, "profile": profile}  # fmt: skip


# Devices and memory.


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def _peak_tflops(device) -> tuple[float, str]:
    """The MFU reference: the GPU's dense bf16 peak from mp_train's table, else a measured
    bf16 matmul on the device (on a CPU, mp_train's cpu_peak_tflops)."""
    import torch

    from mp_train.observability.metrics import cpu_peak_tflops, known_peak_tflops

    known = known_peak_tflops(device)
    if known:
        return known, "table"
    if device.type != "cuda":
        return cpu_peak_tflops(), "measured matmul (the faster of bf16 and fp32)"
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    a @ a
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        a @ a
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * 8192**3 / best / 1e12, "measured bf16 matmul"


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _free(device) -> float:
    """Frees what the finished side left; returns the GiB still allocated on the GPU (0 on
    the CPU): more than a few MiB means the side kept its model alive."""
    import torch

    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**30


def _one_line(text: str) -> str:
    line = next((t for t in text.strip().splitlines() if t.strip()), "")
    return line[:300]
