"""Benchmark: the two compiled paths beside the plain ones, alone, on this machine's
device (CUDA when there is one, else the CPU), in one process taking turns.

- optimizer: MixedPrecisionOptimizer.step() over bf16 parameters with fp32 main
  parameters (one rank, DDP buffers, clipping at 1.0 active), torch's fused AdamW +
  the clipping's multiply + the copies (plain) against --torch-compile-optimizer's one
  compiled kernel per parameter (compiled). The parameters: --layers square linear
  layers of --width (weights and biases).
- loss: vocab_parallel_cross_entropy forward and backward (the gradient written over
  the logits) over [--tokens, --vocab] bf16 logits, plain against fused
  (--cross-entropy-loss-fusion).

Each side is warmed up (its compilation included) before --rounds rounds of --iters
timed calls, the sides alternating each round and their order swapped every round;
figures: the best and the median call, and plain / compiled.

    uv run python ci/bench/bench_fused_step.py [--layers 12] [--width 2048]
        [--tokens 2048] [--vocab 32000] [--rounds 4] [--iters 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import context, emit

import mp_state
from mp_layers.tensor_parallel import vocab_parallel_cross_entropy
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    device = mp_state.init_distributed().device  # a one-rank world
    state = mp_state.initialize(ParallelConfig())
    try:
        optimizer_sides, params = _optimizer_sides(args, state, device)
        loss_sides = _loss_sides(args, device)
        results = {"optimizer": race(optimizer_sides, args, device),
                   "loss": race(loss_sides, args, device)}  # fmt: skip
    finally:
        mp_state.destroy()
    for name, times in results.items():
        best = {side: min(t) for side, t in times.items()}
        median = {side: statistics.median(t) for side, t in times.items()}
        what = (f"{params / 1e6:.1f}M parameters" if name == "optimizer"
                else f"{args.tokens} x {args.vocab} logits")  # fmt: skip
        print(f"{name} ({what}, {device}): plain best {best['plain'] * 1e3:.1f} ms, median "
              f"{median['plain'] * 1e3:.1f}; compiled best {best['compiled'] * 1e3:.1f} ms, "
              f"median {median['compiled'] * 1e3:.1f}; plain / compiled "
              f"{best['plain'] / best['compiled']:.2f}x (median "
              f"{median['plain'] / median['compiled']:.2f}x)")  # fmt: skip
        emit(f"fused_step_{name}", {"device": str(device), "parameters": params,
             "tokens": args.tokens, "vocab": args.vocab,
             **{f"{side}_best_s": best[side] for side in best},
             **{f"{side}_median_s": median[side] for side in median},
             "speedup_best": best["plain"] / best["compiled"],
             "speedup_median": median["plain"] / median["compiled"]}, context())  # fmt: skip


def _optimizer_sides(args, state, device):
    sides = {}
    for name, compiled in (("plain", False), ("compiled", True)):
        optimizer, params = linear_stack_optimizer(args, state, device,
                                                   torch_compile_optimizer=compiled)  # fmt: skip
        sides[name] = optimizer.step
    return sides, params


def linear_stack_optimizer(args, state, device, **settings):
    """(the optimizer, its parameters' count) of --layers bf16 linear layers of --width on
    one rank: OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0, bf16=True,
    **settings), DDP buffers, the gradients drawn (their norm ~ sqrt(parameters), so the
    clipping scales every step). The benchmarks of the optimizer step share it."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    module = torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
    config = OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0, bf16=True, **settings)
    model = DistributedDataParallel(config, module, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    for p in module.parameters():
        p.main_grad.normal_()
    return optimizer, sum(p.numel() for p in module.parameters())


def _loss_sides(args, device):
    group = mp_state.RankGroup("tp", (0,), 0, None)
    gen = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(args.tokens, 1, args.vocab, device=device, generator=gen,
                       dtype=torch.bfloat16)  # fmt: skip
    target = torch.randint(0, args.vocab, (args.tokens, 1), device=device, generator=gen)

    def side(fused: bool):
        def call():
            x = base.detach().requires_grad_()
            logits = x * 1  # not a leaf: its memory takes the gradient
            loss = vocab_parallel_cross_entropy(logits, target, group, grad_in_logits=True,
                                                fused=fused)  # fmt: skip
            loss.mean().backward()

        return call

    return {"plain": side(False), "compiled": side(True)}


def race(sides: dict, args, device) -> dict[str, list[float]]:
    """Seconds of each timed call of every side (the module docstring's rounds)."""
    for call in sides.values():  # warm-up, compilation included
        call()
        call()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in order:
            for _ in range(args.iters):
                _sync(device)
                start = time.perf_counter()
                sides[name]()
                _sync(device)
                times[name].append(time.perf_counter() - start)
    return times


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
