"""Benchmark: the optimizer step with Adam's moments in bf16 (Megatron's precision-aware
optimizer: --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16)
beside fp32 moments, and the bytes the moments take.

MixedPrecisionOptimizer.step() with the distributed optimizer on one rank over bf16
parameters (fp32 main parameters, clipping at 1.0 active): `fp32` is torch's fused AdamW
over fp32 moments, `bf16` LowPrecisionAdamW (the moments widened to fp32 a piece at a
time, the fused AdamW, rounded back), `fp32_compiled` and `bf16_compiled` the same with
--torch-compile-optimizer (the widening and rounding inside the compiled kernel). The
parameters: --layers square linear layers of --width (weights and biases), on this
machine's device. Each side is warmed up (compilation included), then --rounds rounds of
--iters timed steps, the sides alternating, their order reversed every round; figures:
the best and the median step, each over fp32's, and the moments' bytes.

    uv run python ci/bench/bench_moment_dtypes.py [--layers 12] [--width 2048]
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
    "fp32": ("fp32", False),
    "bf16": ("bf16", False),
    "fp32_compiled": ("fp32", True),
    "bf16_compiled": ("bf16", True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    device = mp_state.init_distributed().device  # a one-rank world
    state = mp_state.initialize(ParallelConfig())
    try:
        steps, moment_bytes, params = {}, {}, 0
        for name, (dtype, compiled) in SIDES.items():
            step, optimizer, params = _side(args, state, device, dtype, compiled)
            steps[name] = step
            moment_bytes[name] = sum(t.numel() * t.element_size()
                                     for s in optimizer.optimizer.state.values()
                                     for k, t in s.items() if k != "step")  # fmt: skip
        times = race(steps, args, device)  # (two warm-up steps each, compilation included)
    finally:
        mp_state.destroy()
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    emit("moment_dtypes_step", {
        "device": str(device), "parameters": params,
        "best_ms": {n: round(v * 1e3, 1) for n, v in best.items()},
        "median_ms": {n: round(v * 1e3, 1) for n, v in median.items()},
        "best_over_fp32": {n: round(v / best["fp32"], 3) for n, v in best.items()},
        "moment_bytes": moment_bytes,
    }, context())  # fmt: skip


def _side(args, state, device, dtype: str, compiled: bool):
    optimizer, params = linear_stack_optimizer(
        args, state, device, use_distributed_optimizer=True,
        use_precision_aware_optimizer=dtype != "fp32", exp_avg_dtype=dtype,
        exp_avg_sq_dtype=dtype, torch_compile_optimizer=compiled,
    )  # fmt: skip
    return optimizer.step, optimizer, params


if __name__ == "__main__":
    main()
