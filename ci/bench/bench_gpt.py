"""Benchmark: training tokens/s of apps/gpt's loop beside a plain PyTorch loop over
transformers' LlamaForCausalLM.

One process, all cores (torch.set_num_threads(os.cpu_count())). The model is the
Llama-style shape of bench_layers.py: hidden 512, 8 layers, 8 heads in 4 query
groups of 64 channels, ffn 1376 (SwiGLU), RMSNorm, RoPE, no biases, untied
embeddings, vocabulary 32,000 (NullTokenizer's, the last id its end of document;
a multiple of 128, so Megatron's padding keeps it), sequence 512, micro-batch 4 =
global batch, dropout 0; about 56M parameters.

Ours is the real run: `mp_train.parse_config` of Megatron flags (`--bf16
--mock-data ...`) and `mp_gpt.pretrain.train(config)` in this process (a
one-rank gloo world): data loader, forward/backward through the no-pipelining
schedule, DDP gradient buffers, the mixed-precision optimizer step, the
scheduler, logging every iteration. An iteration's time is the interval between
two consecutive log lines of the loop, so everything it does counts.

The baseline is what one writes by hand for the same job, with the same
precision treatment and the same work:

- bf16 parameters (no autocast), their fp32 gradients and fp32 main parameters
  stepped by torch.optim.AdamW (Megatron's mixed precision, which ours does);
- the same AdamW settings and parameter groups (no weight decay on 1-D
  parameters), the same global-norm clipping to 1.0, the same constant
  learning rate;
- the same samples: mp_gpt's datasets_provider (MockGPTDataset) read by
  mp_data's loader in the same order; the loss is transformers' own
  (shift_labels = the dataset's labels, so both predict the same tokens).

First, both loops train check_iters iterations untimed and their losses are
printed side by side: on the mock corpus (sequences 1, 2, 3, ... closed by an
end-of-document token) both must fall alike, which shows that they do the
same work. Then the two loops take turns: each round trains ours for warm-up +
timed iterations, then the baseline for as many; tokens/s comes from the
fastest timed iteration of each over all rounds (as in bench_layers.py), the
median beside it. Target: ours >= 1.2x the baseline.

MFU: the loop's FLOPs per iteration (mp_train.estimate, Megatron's count: 3
GEMMs per weight, causal attention at half the square) over the measured peak
of a bf16 n x n matmul (mp_train.observability.metrics.measure_peak_tflops, the better of a
measure before and one after the runs).

With --torch-compile the baseline is ours run eagerly instead: the same loop with and
without `--torch-compile` (each transformer layer compiled by inductor), taking turns as
above; the warm-up iterations hold the compilation, whose time is the compiled runs'
first iteration as the loop logs it ("compiled 8 transformer layers ...: first
iteration X s"), the first round's in a fresh inductor cache (the later rounds find
the graphs compiled). Both sides train on the same samples from the same weights: the
largest relative difference of their losses is reported. Target: compiled >= 1.1x.
With --fused-loss the compiled side also fuses the cross entropy
(--cross-entropy-loss-fusion).

    uv run python ci/bench/bench_gpt.py [--rounds 3 --warmup 2 --iters 3 --check-iters 20]
    uv run python ci/bench/bench_gpt.py --torch-compile [--fused-loss] [--rounds 3 ...]

gpu_suite.py runs the same two sides (config_for, run_ours, run_hf) on a GPU, with
other shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from harness import LLAMA_SHAPE, LlamaShape, context, emit

import mp_state
from mp_data import (
    build_pretraining_data_loader,
    build_tokenizer,
    train_valid_test_num_samples,
    vocab_size_with_padding,
)
from mp_gpt.gpt import datasets_provider
from mp_gpt.pretrain import train
from mp_train import estimate, parse_config
from mp_train.observability.metrics import measure_peak_tflops

SHAPE = LlamaShape(*LLAMA_SHAPE)
TARGET_RATIO = 1.2
COMPILED_TARGET_RATIO = 1.1
LR = 1e-3
_LOG_LINE = re.compile(r"^iteration\s+(\d+) \|.*\| ms/iteration ([\d.]+) \|")
_SETUP_LINE = re.compile(r"^time \(ms\) \| model-and-optimizer-setup: \([\d.]+, ([\d.]+)\)")
_COMPILE_LINE = re.compile(r"^compiled \d+ transformer layers? .*: first iteration ([\d.]+) s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch = global batch")
    parser.add_argument("--rounds", type=int, default=3, help="turns of ours, then baseline")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    parser.add_argument(
        "--check-iters",
        type=int,
        default=20,
        help="untimed iterations of each loop first, comparing losses (0: none)",
    )
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the n x n matmul peak")
    parser.add_argument("--show-log", action="store_true", help="print the loop's own log")
    parser.add_argument(
        "--torch-compile", action="store_true", help="ours compiled against ours eager"
    )
    parser.add_argument(
        "--fused-loss", action="store_true",
        help="with --torch-compile: the compiled side also fuses the cross entropy "
        "(--cross-entropy-loss-fusion)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.fused_loss and not args.torch_compile:
        parser.error("--fused-loss compares with --torch-compile: give both")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: a timed iteration is measured from the previous")
    torch.set_num_threads(os.cpu_count() or 1)
    ctx = context()

    peak = measure_peak_tflops(args.peak_n) * 1e12
    iterations = args.warmup + args.iters
    config = _config(args, iterations, peak)
    flops = estimate(config, 1, vocab_size=padded_vocab(config))["flops_per_iteration"]
    tokens = args.batch * args.seq
    if args.torch_compile:
        _compare_compiled(args, iterations, peak, flops, tokens, ctx)
        return

    if args.check_iters:
        _check_convergence(args, peak, ctx)
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    losses: dict[str, list[list[float]]] = {"ours": [], "hf": []}
    logged_ms: list[float] = []
    params = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            config = _config(args, iterations, peak, f"{scratch}/metrics{round_}.jsonl")
            seconds, loss, ms, params["ours"] = run_ours(config, args.show_log)
            times["ours"] += seconds[args.warmup :]
            logged_ms += ms[args.warmup :]
            losses["ours"].append(loss)
            seconds, loss, params["hf"] = run_hf(config, SHAPE, iterations)
            times["hf"] += seconds[args.warmup :]
            losses["hf"].append(loss)

    # Measured again at the end: the better of the two is the machine's (another
    # process running during one of them lowers it).
    peak = max(peak, measure_peak_tflops(args.peak_n) * 1e12)
    emit("matmul_peak[bf16]", {"tflops": round(peak / 1e12, 4), "n": args.peak_n}, ctx)
    falls = {k: all(run[-1] < run[0] for run in v) for k, v in losses.items()}
    shape = {
        "hidden": SHAPE.hidden, "layers": SHAPE.layers, "heads": SHAPE.heads,
        "query_groups": SHAPE.query_groups, "ffn": SHAPE.ffn, "vocab": SHAPE.vocab,
        "padded_vocab": padded_vocab(config),
        "sequence_length": args.seq, "batch": args.batch, "rounds": args.rounds,
        "warmup_per_run": args.warmup, "timed_per_run": args.iters,
        "precision": "bf16 parameters, fp32 gradients and main parameters (both)",
    }  # fmt: skip
    emit(
        "gpt_train_iteration[bf16]",
        {
            **_side_by_side(times["ours"], times["hf"], "hf", TARGET_RATIO, tokens, flops, peak),
            "loop_logged_ms_per_iteration": [round(t, 1) for t in logged_ms],
            "matmul_peak_tflops": round(peak / 1e12, 4),
            "flops_per_iteration": flops,
            "losses": [[round(x, 3) for x in run] for run in losses["ours"]],
            "hf_losses": [[round(x, 3) for x in run] for run in losses["hf"]],
            "losses_fall": falls["ours"],
            "hf_losses_fall": falls["hf"],
            "parameters": params["ours"],
            "hf_parameters": params["hf"],
            **shape,
        },
        ctx,
    )


def _compare_compiled(args, iterations: int, peak: float, flops: float, tokens: int,
                      ctx) -> None:  # fmt: skip
    """Ours with --torch-compile beside ours eager, taking turns (module docstring)."""
    sides = ("eager", "compiled")
    times: dict[str, list[float]] = {side: [] for side in sides}
    first: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[list[float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{scratch}/inductor"
        for round_ in range(args.rounds):
            for side in sides:
                extra = _compiled_flags(args) if side == "compiled" else []
                config = _config(args, iterations, peak, f"{scratch}/{side}{round_}.jsonl", extra)
                (seconds, loss, ms, _), compile_s, _ = _run_ours(config, args.show_log)
                times[side] += seconds[args.warmup :]
                # The eager loop's first logged interval (from the loop's start).
                first[side].append(compile_s if side == "compiled" else ms[0] / 1000)
                losses[side].append(loss)
    peak = max(peak, measure_peak_tflops(args.peak_n) * 1e12)  # as in main()
    difference = max(
        abs(c - e) / abs(e)
        for run_c, run_e in zip(losses["compiled"], losses["eager"], strict=True)
        for c, e in zip(run_c, run_e, strict=True)
    )
    emit(
        "gpt_train_iteration_compiled[bf16]",
        {
            "compiled_flags": _compiled_flags(args),
            **_side_by_side(times["compiled"], times["eager"], "eager", COMPILED_TARGET_RATIO,
                            tokens, flops, peak),
            "first_iteration_s": [round(t, 1) for t in first["compiled"]],
            "eager_first_iteration_s": [round(t, 2) for t in first["eager"]],
            "matmul_peak_tflops": round(peak / 1e12, 4),
            "losses": [round(x, 4) for x in losses["compiled"][0]],
            "eager_losses": [round(x, 4) for x in losses["eager"][0]],
            "max_loss_relative_difference": float(f"{difference:.2e}"),
            "hidden": SHAPE.hidden, "layers": SHAPE.layers, "sequence_length": args.seq,
            "batch": args.batch, "rounds": args.rounds, "warmup_per_run": args.warmup,
            "timed_per_run": args.iters,
        },
        ctx,
    )  # fmt: skip


def _compiled_flags(args) -> list[str]:
    return ["--torch-compile", *(["--cross-entropy-loss-fusion"] if args.fused_loss else [])]


def _side_by_side(ours: list[float], base: list[float], name: str, target: float, tokens: int,
                  flops: float, peak: float) -> dict:  # fmt: skip
    """Ours against the baseline `name` from their timed iterations' seconds: tokens/s
    of the fastest, the ratio of the fastest and of the medians, TFLOP/s and MFU."""
    best = {"ours": min(ours), name: min(base)}
    ratio = best[name] / best["ours"]
    return {
        "tokens_per_s": round(tokens / best["ours"], 1),
        f"{name}_tokens_per_s": round(tokens / best[name], 1),
        f"ratio_to_{name}": round(ratio, 3),
        f"ratio_to_{name}_median": round(statistics.median(base) / statistics.median(ours), 3),
        "target_ratio": target,
        "meets_target": ratio >= target,
        "iteration_s": [round(t, 3) for t in ours],
        f"{name}_iteration_s": [round(t, 3) for t in base],
        "achieved_tflops": round(flops / best["ours"] / 1e12, 4),
        f"{name}_achieved_tflops": round(flops / best[name] / 1e12, 4),
        "mfu": round(flops / best["ours"] / peak, 3),
        f"{name}_mfu": round(flops / best[name] / peak, 3),
    }


def _check_convergence(args, peak: float, ctx) -> None:
    """Both loops on the same samples for check_iters iterations: the losses must fall
    alike (the two do the same work)."""
    with tempfile.TemporaryDirectory() as scratch:
        config = _config(args, args.check_iters, peak, f"{scratch}/metrics.jsonl")
        _, ours, _, _ = run_ours(config, show_log=False)
        _, hf, _ = run_hf(config, SHAPE, args.check_iters)
    tail = max(1, args.check_iters // 4)
    last = {"ours": statistics.mean(ours[-tail:]), "hf": statistics.mean(hf[-tail:])}
    emit(
        "gpt_convergence[bf16]",
        {
            "iterations": args.check_iters,
            "losses": [round(x, 3) for x in ours],
            "hf_losses": [round(x, 3) for x in hf],
            f"mean_of_last_{tail}": round(last["ours"], 3),
            f"hf_mean_of_last_{tail}": round(last["hf"], 3),
            "both_fall": last["ours"] < ours[0] - 1.0 and last["hf"] < hf[0] - 1.0,
        },
        ctx,
    )


# Ours: the real training loop.


def _config(args, iterations: int, peak: float, metrics_file: str | None = None,
            extra: list[str] | None = None):  # fmt: skip
    argv = config_argv(SHAPE, args.seq, args.batch, iterations, peak / 1e12, metrics_file)
    return parse_config(argv + (extra or []))


def config_argv(shape: LlamaShape, seq: int, batch: int, iterations: int, peak_tflops: float,
                metrics_file: str | None = None) -> list[str]:  # fmt: skip
    """The run's flags: `shape`, bf16, micro-batch = global batch = `batch`, mock data over
    shape.vocab ids, constant learning rate, clipping at 1.0, a log line per iteration
    with MFU against `peak_tflops`, no evaluation, no checkpoints; the model built and
    drawn on the run's device, as the transformers baseline is (on a CPU no change)."""
    argv = [
        *shape.flags(),
        "--seq-length", str(seq), "--micro-batch-size", str(batch),
        "--global-batch-size", str(batch), "--train-iters", str(iterations),
        "--eval-interval", "none",
        "--bf16", "--lr", str(LR), "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--mock-data", "--vocab-size", str(shape.vocab), "--make-vocab-size-divisible-by", "128",
        "--num-workers", "0", "--split", "100,0,0",
        "--log-interval", "1", "--peak-tflops", str(peak_tflops),
        "--use-device-initialization",
    ]  # fmt: skip
    if metrics_file is not None:
        argv += ["--metrics-file", metrics_file]
    return argv


def run_ours(config, show_log: bool = False) -> tuple[list[float], list[float], list[float], int]:
    """(seconds per iteration, losses, the loop's own ms/iteration, parameters)."""
    return _run_ours(config, show_log)[0]


def run_ours_and_setup(config) -> tuple[tuple[list[float], list[float], list[float], int], float]:
    """(run_ours' figures, the milliseconds the loop logs for building the model and the
    optimizer: its model-and-optimizer-setup timer, the slowest rank's)."""
    figures, _, setup_ms = _run_ours(config, False)
    return figures, setup_ms


def _run_ours(config, show_log: bool) -> tuple[tuple, float | None, float]:
    """(run_ours' figures, the first iteration's seconds that a compiled run logs, or
    None, and the model-and-optimizer-setup milliseconds it logs)."""
    clock = _LineClock(show_log)
    try:
        with contextlib.redirect_stdout(clock):
            run = train(config)
        params = sum(p.numel() for chunk in run.model for p in chunk.parameters())
    finally:
        mp_state.destroy()
    stamps = [t for t, line in clock.lines if _LOG_LINE.match(line)]
    logged = [float(_LOG_LINE.match(line).group(2)) for _, line in clock.lines
              if _LOG_LINE.match(line)]  # fmt: skip
    if len(stamps) != config.training.train_iters:
        raise RuntimeError(f"expected {config.training.train_iters} log lines, got {len(stamps)}")
    # The first iteration has no previous line: it is always a warm-up one.
    seconds = [float("nan")] + [b - a for a, b in itertools.pairwise(stamps)]
    lines = Path(config.logging.metrics_file).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    compiled = [float(m.group(1)) for _, line in clock.lines if (m := _COMPILE_LINE.match(line))]
    [setup_ms] = [float(m.group(1)) for _, line in clock.lines if (m := _SETUP_LINE.match(line))]
    figures = (seconds, [r["lm loss"] for r in records], logged, params)
    return figures, next(iter(compiled), None), setup_ms


class _LineClock(io.TextIOBase):
    """A stdout stand-in that notes when each line arrives."""

    def __init__(self, echo: bool) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""
        self._echo = echo

    def write(self, text: str) -> int:
        now = time.perf_counter()
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        for line in complete:
            self.lines.append((now, line))
            if self._echo:
                print(line, file=sys.__stdout__, flush=True)
        return len(text)


# The baseline: a plain loop over transformers' Llama.


def run_hf(config, shape: LlamaShape, iterations: int,
           device: torch.device | str = "cpu") -> tuple[list[float], list[float], int]:  # fmt: skip
    """(seconds per iteration, losses, parameters) of the baseline on `device` (built
    there, batches moved there)."""
    import transformers

    torch.manual_seed(config.training.seed)
    hf_config = shape.hf_config(padded_vocab(config), config.gpt.seq_length)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fp32 main parameters and gradients, allocated once (as ours keeps its buffers).
    main = [p.detach().float() for p in params]
    for m in main:
        m.grad = torch.zeros_like(m)
    optimizer_config = config.optimizer
    decayed = [m for m, p in zip(main, params, strict=True) if p.dim() > 1]
    not_decayed = [m for m, p in zip(main, params, strict=True) if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": not_decayed, "weight_decay": 0.0},
         {"params": decayed, "weight_decay": optimizer_config.weight_decay}],
        lr=optimizer_config.lr, betas=(optimizer_config.adam_beta1, optimizer_config.adam_beta2),
        eps=optimizer_config.adam_eps,
    )  # fmt: skip
    batches = iter(_loader(config))
    seconds, losses = [], []
    for _ in range(iterations):
        start = time.perf_counter()
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in next(batches).items()}  # fmt: skip
        out = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                    labels=batch["labels"], shift_labels=batch["labels"])  # fmt: skip
        out.loss.backward()
        for m, p in zip(main, params, strict=True):
            m.grad.copy_(p.grad)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(main, optimizer_config.clip_grad)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(main, params, strict=True):
                p.copy_(m)
        losses.append(float(out.loss.detach()))
        seconds.append(time.perf_counter() - start)
    return seconds, losses, sum(p.numel() for p in params)


def _loader(config):
    """The training loop's samples, in its order: mp_gpt's datasets_provider on a
    one-rank stand-in of the run, mp_data's loader."""
    one = SimpleNamespace(rank=0, size=1)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=config.data.vocab_size)
    stand_in = SimpleNamespace(config=config, state=SimpleNamespace(tp=one, pp=one),
                               tokenizer=tokenizer)  # fmt: skip
    training = config.training
    counts = train_valid_test_num_samples(
        training.train_iters, training.micro_batch_size, training.eval_interval or 0,
        training.eval_iters,
    )  # fmt: skip
    train_set, _, _ = datasets_provider(stand_in, counts)
    return build_pretraining_data_loader(
        train_set, 0, dataloader_type="single", micro_batch_size=training.micro_batch_size,
        data_parallel_rank=0, data_parallel_size=1, num_workers=0,
    )  # fmt: skip


def padded_vocab(config) -> int:
    """The loop's vocabulary: NullTokenizer's ids (its end-of-document id among them), padded."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=config.data.vocab_size)
    return vocab_size_with_padding(tokenizer.vocab_size, config.data.make_vocab_size_divisible_by)


if __name__ == "__main__":
    main()
