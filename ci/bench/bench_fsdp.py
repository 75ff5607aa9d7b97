"""Benchmark: per-rank memory of ZeRO-0/1/2/3, and ZeRO-3's step time against DDP's.

Both measures drive apps/gpt's real pieces on CPU ranks over gloo, forked by
mp_state.testing.run_on_ranks, one thread each: `mp_train.parse_config` of Megatron
flags, `mp_train.setup_run` with mp_gpt's model_provider (the GPTModel chunk wrapped
in DistributedDataParallel, or FullyShardedDataParallel for ZeRO-2/3, get_optimizer,
the scheduler), and a training step as the loop takes it: optimizer.zero_grad(), the
no-pipelining schedule over mp_gpt's forward_step (one micro-batch of random tokens,
its labels the next tokens, a different stream on every rank), optimizer.step(),
scheduler.step(). AdamW (fused), lr 1e-4, clipping at 1.0.

    level   flags                                                       dp
    zero0   (none): DDP                                                 --ddp-dp (2)
    zero1   --use-distributed-optimizer                                 4
    zero2   --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads
    zero3   --use-megatron-fsdp (optim_grads_params)                    4

`memory`: a Llama-shaped model of about 200M parameters (hidden 1024, 12 layers, 16
heads in 4 query groups of 64 channels, ffn 2816, SwiGLU, RMSNorm, RoPE, untied
embeddings, vocabulary 32,000 (NullTokenizer's, its end-of-document id the last; not
padded); 200,827,904 parameters), sequence 128, micro-batch 1, in bf16 (bf16 parameters,
fp32 gradients and main parameters: Megatron's mixed precision) and in fp32. Each
level runs in fresh ranks and takes `--steps` steps (so that Adam's moments exist);
then each rank counts the bytes it holds, each storage once (untyped_storage, by
address), in the first of these that reaches it:

    parameters        the model's parameters: DDP's (with the distributed optimizer,
                      its contiguous parameter buffer); FSDP's local shards (padded
                      as FSDP2 pads them)
    gradients         each parameter's .main_grad (DDP's gradient buffers; FSDP's
                      persistent gradient shards) and any .grad
    main_params       the optimizer's fp32 main parameters, where they are copies
                      (bf16 under DDP; fp32 ones are the model's own memory)
    optimizer_state   the torch optimizer's state: exp_avg, exp_avg_sq, step

and reads its resident set (Linux /proc/self/status): `rss_mib`, between steps (after
malloc_trim); `rss_growth_mib`, that minus the resident set before setup_run (torch and
mp's modules loaded), what the run holds as the process sees it; `step_peak_mib`, the
peak of the last step (VmHWM, reset at its start by `echo 5 > /proc/self/clear_refs`);
`setup_peak_mib`, ru_maxrss after setup_run (the model built, wrapped and sharded);
`process_peak_mib`, the larger of that and every step's peak: the whole run's. Each is
the largest rank's. The issue's ratio is the counted state (the four kinds) per rank
against DDP's: ZeRO-3 <= 0.3x, ZeRO-2 <= 0.45x.

DDP runs at dp 2, not 4, by default: under DDP every rank holds the whole model, its
gradients and the optimizer state whatever dp is, so its counted bytes per rank are
the same (no buffer of DDP depends on dp; `--ddp-dp 4` shows it), and four 200M DDP
ranks in bf16 hold about 16 GiB together, more than a shared 24 GiB machine should
give one benchmark.

`speed`: ZeRO-3 against DDP at dp 2, in bf16, on the ~56M-parameter Llama shape of
bench_gpt.py (harness.LLAMA_SHAPE: vocabulary 32,000, 55,976,448
parameters), sequence 256, at each micro-batch of `--speed-batch` (2: about a second
per step; 8). Both sides live in the same two processes (one mp_state, two
setup_runs), built from the same seed and fed the same data. Correctness first: their
first step's loss and gradient norm must agree within RTOL, or the run stops (they
would be doing different work). Then each side takes `--warmup` untimed steps, and the
sides alternate for `--iters` timed steps (the order flips every round), each after a
barrier, timed on rank 0. Tokens/s = global tokens per step (dp x micro-batch x
sequence) / step seconds; the figures are the best and the median, ZeRO-3's ratio to
DDP's of each, and the median of the per-round ratios. Target: ZeRO-3 >= 0.8x DDP's
tokens/s. Both sides (and every memory level) run as mp's CPU runs do, with glibc's
malloc keeping what a step frees (mp_train/loop/cpu_allocator.py, set by initialize);
`MALLOC_MMAP_MAX_=65536` in the environment measures glibc's default instead. Beside
them, `collectives_s`: each gloo collective a step issues, timed on
the same ranks as one call over the whole model (DDP: one all-reduce of the fp32
gradients; ZeRO-3: two all-gathers of the bf16 parameters and one reduce-scatter of
the fp32 gradients), which is where most of ZeRO-3's extra time goes on CPU, and
`collectives_peak_growth_mib`, what each call allocates at its peak (VmHWM reset
before it).

    uv run python ci/bench/bench_fsdp.py [--measure memory speed] [--precision bf16 fp32]
        [--speed-batch 2 8] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from harness import LLAMA_SHAPE, LlamaShape, context, emit, reset_peak_rss, status_mib, take_turns

from mp_state.testing import run_on_ranks

LEVELS = {
    "zero0": [],
    "zero1": ["--use-distributed-optimizer"],
    "zero2": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    "zero3": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
}
ENGINES = {
    "zero0": "DDP",
    "zero1": "DDP + distributed optimizer",
    "zero2": "FullyShardedDataParallel",
    "zero3": "FullyShardedDataParallel",
}
MEMORY_SHAPE = LlamaShape(hidden=1024, layers=12, heads=16, query_groups=4, head_dim=64,
                          ffn=2816, vocab=32000)  # fmt: skip
SPEED_SHAPE = LlamaShape(*LLAMA_SHAPE)
TARGET_MEMORY_RATIO = {"zero2": 0.45, "zero3": 0.3}
TARGET_SPEED_RATIO = 0.8
RTOL = {"bf16": 1e-2, "fp32": 1e-5}
"""Largest relative difference of ZeRO-3's first-step loss and gradient norm from DDP's."""
KINDS = ("parameters", "gradients", "main_params", "optimizer_state")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", nargs="+", choices=("memory", "speed"),
                        default=["memory", "speed"], help="what to measure")  # fmt: skip
    parser.add_argument("--precision", nargs="+", choices=("bf16", "fp32"),
                        default=["bf16", "fp32"], help="memory: the precisions run")  # fmt: skip
    parser.add_argument("--dp", type=int, default=4, help="memory: data-parallel ranks")
    parser.add_argument("--ddp-dp", type=int, default=2, help="memory: DDP's ranks")
    parser.add_argument("--steps", type=int, default=2, help="memory: steps before counting")
    parser.add_argument("--memory-seq", type=int, default=128, help="memory: sequence")
    parser.add_argument("--speed-seq", type=int, default=256, help="speed: sequence")
    parser.add_argument("--speed-batch", type=int, nargs="+", default=[2, 8],
                        help="speed: micro-batches per rank, one run each")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2, help="speed: untimed steps per side")
    parser.add_argument("--iters", type=int, default=8, help="speed: timed steps per side")
    parser.add_argument("--speed-precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a quick check")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    args = parser.parse_args()
    ctx = context()
    if "memory" in args.measure:
        for precision in args.precision:
            emit(f"fsdp_memory[{precision},dp={args.dp}]", _memory(precision, args), ctx)
    if "speed" in args.measure:
        for batch in args.speed_batch:
            measure = f"fsdp_step[{args.speed_precision},dp=2,micro_batch={batch}]"
            emit(measure, _speed(batch, args), ctx)


# Memory.


def _memory(precision: str, args) -> dict:
    shape = TINY_SHAPE if args.tiny else MEMORY_SHAPE
    levels = {}
    for level, flags in LEVELS.items():
        dp = args.ddp_dp if level == "zero0" else args.dp
        argv = run_argv(shape, precision, args.memory_seq, 1, dp) + flags
        ranks = run_on_ranks(_memory_rank, dp, argv, args.steps, timeout=args.timeout)
        levels[level] = {"dp": dp, "ranks": ranks}
    base = _state_bytes(levels["zero0"]["ranks"])
    base_growth = _rss_growth(levels["zero0"]["ranks"])
    figures: dict = {}
    for level, measured in levels.items():
        ranks = measured["ranks"]
        state = _state_bytes(ranks)
        row = {
            "engine": ENGINES[level],
            "dp": measured["dp"],
            "state_mib_per_rank": _mib(state),
            "ratio_to_ddp": round(state / base, 3),
            **{f"{k}_mib": _mib(max(r["bytes"][k] for r in ranks)) for k in KINDS},
            "bytes_per_parameter": round(state / ranks[0]["parameters"], 2),
            "rss_mib": round(max(r["rss_mib"] for r in ranks), 1),
            "rss_growth_mib": round(_rss_growth(ranks), 1),
            "rss_growth_ratio_to_ddp": round(_rss_growth(ranks) / base_growth, 3),
            "step_peak_mib": round(max(r["step_peak_mib"] for r in ranks), 1),
            "setup_peak_mib": round(max(r["setup_peak_mib"] for r in ranks), 1),
            "process_peak_mib": round(max(r["process_peak_mib"] for r in ranks), 1),
            "losses": [round(x, 4) for x in ranks[0]["losses"]],
        }
        if level in TARGET_MEMORY_RATIO:
            row["target_ratio"] = TARGET_MEMORY_RATIO[level]
            row["meets_target"] = state / base <= TARGET_MEMORY_RATIO[level]
        figures[level] = row
    first = levels["zero0"]["ranks"][0]
    return {
        "levels": figures,
        "parameters": first["parameters"],
        **_shape_figures(shape, args.memory_seq, 1),
        "precision": _PRECISION[precision],
        "steps_before_counting": args.steps,
        "threads_per_rank": 1,
        "count_method": "distinct untyped storages (by address) held by the parameters, "
        ".main_grad / .grad, the optimizer's main parameters and state; per rank, the "
        "largest rank's",
        "rss_method": "the largest rank's: VmRSS after the last step and malloc_trim "
        "(growth: minus VmRSS before setup_run); VmHWM over the last step (reset at its "
        "start); ru_maxrss after setup_run; the largest of those peaks",
    }


def _state_bytes(ranks: list[dict]) -> int:
    """The largest rank's parameters + gradients + optimizer state."""
    return max(sum(r["bytes"][k] for k in KINDS) for r in ranks)


def _rss_growth(ranks: list[dict]) -> float:
    """The largest rank's resident set between steps over its resident set before
    setup_run (the interpreter, torch and mp's modules loaded)."""
    return max(r["rss_mib"] - r["start_rss_mib"] for r in ranks)


def _memory_rank(argv: list[str], steps: int) -> dict:
    import mp_gpt.gpt  # noqa: F401  (what _setup imports, before the first reading)
    import mp_train  # noqa: F401

    start_rss = reset_peak_rss()
    run, forward_step, schedule = _setup(argv)
    # Read before the first reset: clear_refs resets the peak ru_maxrss reports too.
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    losses, step_peaks = [], []
    for _ in range(steps):
        reset_peak_rss()
        losses.append(train_step(run, forward_step, schedule)[0])
        step_peaks.append(status_mib("VmHWM"))
    figures = {
        "bytes": held_bytes(run.model, run.optimizer),
        "parameters": _global_parameters(run.model),
        "losses": losses,
        "start_rss_mib": start_rss,
        "setup_peak_mib": setup_peak,
        "step_peak_mib": step_peaks[-1],
        "process_peak_mib": max(setup_peak, *step_peaks),
        "rss_mib": reset_peak_rss(),
    }
    teardown()
    return figures


def held_bytes(chunks: list, optimizer) -> dict[str, int]:
    """Bytes this rank holds in each of KINDS, every storage counted once, in the first
    kind that reaches it (an fp32 main parameter that is the model's memory counts as a
    parameter)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = [p for chunk in chunks for p in chunk.module.parameters()]
    inner = optimizer.optimizer
    state = inner.state.values()
    return {
        "parameters": count(params),
        "gradients": count(getattr(p, "main_grad", None) for p in params)
        + count(p.grad for p in params),
        "main_params": count(p for group in inner.param_groups for p in group["params"]),
        "optimizer_state": count(v for s in state for v in s.values() if torch.is_tensor(v)),
    }


def _global_parameters(chunks: list) -> int:
    """The model's parameters (whole tensors, not this rank's shards)."""
    return sum(p.numel() for chunk in chunks for p in chunk.module.parameters())


# Speed.


def _speed(batch: int, args) -> dict:
    shape = TINY_SHAPE if args.tiny else SPEED_SHAPE
    precision = args.speed_precision
    argv = run_argv(shape, precision, args.speed_seq, batch, 2)
    load_before = round(os.getloadavg()[0], 2)
    ranks = run_on_ranks(_speed_rank, 2, argv, args, timeout=args.timeout)
    # Other processes on the machine show here (the two ranks themselves add about 2).
    load = {"load_1min_before": load_before, "load_1min_after": round(os.getloadavg()[0], 2)}
    times = ranks[0]["times"]
    tokens = 2 * batch * args.speed_seq
    best = {side: tokens / min(t) for side, t in times.items()}
    median = {side: tokens / statistics.median(t) for side, t in times.items()}
    paired = [d / z for z, d in zip(times["zero3"], times["zero0"], strict=True)]
    ratio = best["zero3"] / best["zero0"]
    return {
        "tokens_per_s": round(best["zero3"], 1),
        "ddp_tokens_per_s": round(best["zero0"], 1),
        "ratio_to_ddp": round(ratio, 3),
        "ratio_to_ddp_median": round(median["zero3"] / median["zero0"], 3),
        "ratio_to_ddp_paired_median": round(statistics.median(paired), 3),
        "target_ratio": TARGET_SPEED_RATIO,
        "meets_target": ratio >= TARGET_SPEED_RATIO,
        "tokens_per_s_median": round(median["zero3"], 1),
        "ddp_tokens_per_s_median": round(median["zero0"], 1),
        "step_s": [round(t, 3) for t in times["zero3"]],
        "ddp_step_s": [round(t, 3) for t in times["zero0"]],
        "first_step_loss_rel_diff": ranks[0]["loss_rel_diff"],
        "first_step_grad_norm_rel_diff": ranks[0]["grad_norm_rel_diff"],
        "collectives_s": ranks[0]["collectives"]["seconds"],
        "collectives_peak_growth_mib": ranks[0]["collectives"]["peak_growth_mib"],
        "parameters": ranks[0]["parameters"],
        "dp": 2,
        **_shape_figures(shape, args.speed_seq, batch),
        "precision": _PRECISION[precision],
        "warmup_steps": args.warmup,
        "timed_steps": args.iters,
        "threads_per_rank": 1,
        **load,
    }


def _speed_rank(argv: list[str], args) -> dict:
    runs, steps, rank = side_runs(argv, {side: LEVELS[side] for side in ("zero0", "zero3")})
    configs = {side: run.config for side, run in runs.items()}
    # The same first batch for both sides.
    first = {side: step() for side, step in steps.items()}
    (loss0, norm0), (loss3, norm3) = first["zero0"], first["zero3"]
    loss_diff = abs(loss3 - loss0) / abs(loss0)
    norm_diff = abs(norm3 - norm0) / abs(norm0)
    tolerance = RTOL[args.speed_precision]
    if not (loss_diff <= tolerance and norm_diff <= tolerance):
        raise RuntimeError(
            f"rank {rank}: ZeRO-3's first step (loss {loss3}, gradient norm {norm3}) differs "
            f"from DDP's (loss {loss0}, gradient norm {norm0}) by more than {tolerance:.0e} "
            "relative, so the two do not do the same work"
        )
    times = take_turns(steps, args.warmup, args.iters)
    parameters = _global_parameters(runs["zero0"].model)
    result = {
        "times": times,
        "collectives": _collectives(parameters, configs["zero3"].optimizer.model_dtype),
        "loss_rel_diff": float(f"{loss_diff:.2e}"),
        "grad_norm_rel_diff": float(f"{norm_diff:.2e}"),
        "parameters": parameters,
    }
    teardown()
    return result


def _collectives(parameters: int, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
    """The fastest of `repeats` of each gloo collective a step issues, each as one call
    over the whole model: DDP all-reduces the fp32 gradients; ZeRO-3 all-gathers the
    parameters (in the compute dtype) twice, forward and backward, and reduce-scatters
    the fp32 gradients (FSDP2 splits them into one call per layer and one for the rest).
    Beside the seconds, what each call allocates at its peak (the resident set's)."""
    numel = parameters + parameters % 2
    grads, grad_shard = torch.ones(numel), torch.empty(numel // 2)
    params, param_shard = torch.empty(numel, dtype=dtype), torch.ones(numel // 2, dtype=dtype)
    calls = {
        "all_reduce_grads": lambda: dist.all_reduce(grads),
        "reduce_scatter_grads": lambda: dist.reduce_scatter_tensor(grad_shard, grads),
        "all_gather_params": lambda: dist.all_gather_into_tensor(params, param_shard),
    }
    best, peaks = {}, {}
    for name, call in calls.items():
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            before = reset_peak_rss()
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
            peaks[name] = round(status_mib("VmHWM") - before, 1)
        best[name] = round(min(seconds), 3)
    best["ddp_per_step"] = best["all_reduce_grads"]
    best["zero3_per_step"] = round(best["reduce_scatter_grads"] + 2 * best["all_gather_params"], 3)
    return {"seconds": best, "peak_growth_mib": peaks}


# One run on a rank (bench_fsdp_overlap.py builds its runs and steps with these too).

TINY_SHAPE = LlamaShape(hidden=128, layers=2, heads=4, query_groups=2, head_dim=32, ffn=352,
                        vocab=1000)  # fmt: skip

_PRECISION = {
    "bf16": "bf16 parameters, fp32 gradients and main parameters (FSDP: fp32 shards, "
    "bf16 gathered for compute)",
    "fp32": "fp32",
}


def run_argv(shape: LlamaShape, precision: str, seq: int, micro_batch: int, dp: int) -> list[str]:
    argv = [
        *shape.flags(),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch * dp),
        "--train-iters", "1000", "--lr", "1e-4", "--lr-decay-style", "constant",
        "--clip-grad", "1.0", "--mock-data", "--vocab-size", str(shape.vocab),
        "--make-vocab-size-divisible-by", "128", "--seed", "1234",
        "--save", "none", "--load", "none", "--tensorboard-dir", "none",
        "--logging-level", "warning",
    ]  # fmt: skip
    return argv + (["--bf16"] if precision == "bf16" else [])


def side_runs(argv: list[str], sides: dict[str, list[str]]):
    """Every side's run (argv + its flags) in this rank's process (one thread; one
    mp_state, initialized by the first side), each with a function taking one training
    step on its own stream of random batches; (runs, steps, dp rank)."""
    torch.set_num_threads(1)
    os.environ["MP_RUN_DIR"] = "/nonexistent"  # no run directory
    from mp_gpt.gpt import model_provider
    from mp_pipeline import get_forward_backward_func
    from mp_train import initialize, parse_config, setup_run

    configs = {side: parse_config(argv + flags) for side, flags in sides.items()}
    with contextlib.redirect_stdout(io.StringIO()):
        initialized = initialize(next(iter(configs.values())))
        runs = {s: setup_run(c, model_provider, initialized) for s, c in configs.items()}
    schedule = get_forward_backward_func(1, None)
    rank = initialized.state.dp.rank
    steps = {}
    for side, run in runs.items():
        forward_step = forward_step_over(random_batches(run.config, rank))
        steps[side] = lambda run=run, forward_step=forward_step: train_step(
            run, forward_step, schedule
        )
    return runs, steps, rank


def _setup(argv: list[str]):
    """setup_run of argv on this rank (one thread), the forward step and the schedule."""
    torch.set_num_threads(1)
    os.environ["MP_RUN_DIR"] = "/nonexistent"  # no run directory
    from mp_gpt.gpt import model_provider
    from mp_pipeline import get_forward_backward_func
    from mp_train import parse_config, setup_run

    config = parse_config(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        run = setup_run(config, model_provider)
    forward_step = forward_step_over(random_batches(config, run.state.dp.rank))
    return run, forward_step, get_forward_backward_func(1, None)


def random_batches(config, dp_rank: int):
    """Endless micro-batches of random tokens in mp_gpt's sample layout, per dp rank."""
    generator = torch.Generator().manual_seed(1 + dp_rank)
    batch, seq = config.training.micro_batch_size, config.gpt.seq_length
    vocab = config.data.vocab_size
    positions = torch.arange(seq).expand(batch, seq)
    while True:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        yield {"tokens": ids[:, :-1], "labels": ids[:, 1:], "position_ids": positions,
               "loss_mask": torch.ones(batch, seq)}  # fmt: skip


def forward_step_over(batches):
    from mp_gpt.gpt import forward_step

    def step(_data_iterator, model):
        return forward_step(batches, model)

    return step


def train_step(run, forward_step, schedule) -> tuple[float, float]:
    """One step as the loop takes it; (loss, gradient norm)."""
    run.optimizer.zero_grad()
    reports = schedule(forward_step_func=forward_step, data_iterator=None, model=run.model,
                       num_microbatches=1, config=run.pipeline, pp_group=run.state.pp)  # fmt: skip
    result = run.optimizer.step()
    run.scheduler.step(increment=run.config.training.global_batch_size)
    total, tokens = (float(x) for x in reports[0]["lm loss"])
    return total / tokens, result.grad_norm


def teardown() -> None:
    import mp_state

    mp_state.destroy()


def _shape_figures(shape: LlamaShape, seq: int, micro_batch: int) -> dict:
    return {
        "hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads,
        "query_groups": shape.query_groups, "ffn": shape.ffn, "vocab": shape.vocab,
        "sequence_length": seq, "micro_batch_per_rank": micro_batch,
    }  # fmt: skip


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


if __name__ == "__main__":
    main()
