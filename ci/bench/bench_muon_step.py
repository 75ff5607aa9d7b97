"""Benchmark: the optimizer step of Muon (--optimizer muon) beside Adam's.

MixedPrecisionOptimizer.step() on one rank over bf16 parameters (fp32 main parameters,
clipping at 1.0 active): `adam` is torch's fused AdamW over every parameter; `muon_bf16`
Muon over the weights with its Newton-Schulz iterations in bf16 (Megatron's default,
--muon-fp32-matmul-prec medium) and fused AdamW over the biases; `muon_fp32` the same
with fp32 iterations (high). The parameters: --layers square linear layers of --width
(weights and biases), on this machine's device. Each side is warmed up, then --rounds
rounds of --iters timed steps, the sides alternating, their order reversed every round;
figures: the best and the median step, each over adam's, and the state's bytes. The
iterations' matmuls dominate Muon's step: 5 x 3 of [w, w] x [w, w] per weight.

    uv run python ci/bench/bench_muon_step.py [--layers 4] [--width 512]
        [--rounds 4] [--iters 2]
"""

from __future__ import annotations

import argparse
import statistics

from bench_fused_step import linear_stack_optimizer, race
from harness import context, emit

import mp_state
from mp_state import ParallelConfig

SIDES = {
    "adam": dict(optimizer="adam"),
    "muon_bf16": dict(optimizer="muon", muon_fp32_matmul_prec="medium"),
    "muon_fp32": dict(optimizer="muon", muon_fp32_matmul_prec="high"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    device = mp_state.init_distributed().device  # a one-rank world
    state = mp_state.initialize(ParallelConfig())
    try:
        steps, optimizers, params = {}, {}, 0
        for name, settings in SIDES.items():
            optimizers[name], params = linear_stack_optimizer(args, state, device, **settings)
            steps[name] = optimizers[name].step
        times = race(steps, args, device)  # (two warm-up steps each)
        state_bytes = {name: sum(t.numel() * t.element_size()
                                 for s in optimizer.optimizer.state.values()
                                 for k, t in s.items() if k != "step")
                       for name, optimizer in optimizers.items()}  # fmt: skip
    finally:
        mp_state.destroy()
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    emit("muon_step", {
        "device": str(device), "parameters": params, "width": args.width,
        "best_ms": {n: round(v * 1e3, 1) for n, v in best.items()},
        "median_ms": {n: round(v * 1e3, 1) for n, v in median.items()},
        "best_over_adam": {n: round(v / best["adam"], 2) for n, v in best.items()},
        "state_bytes": state_bytes,
    }, context())  # fmt: skip


if __name__ == "__main__":
    main()
