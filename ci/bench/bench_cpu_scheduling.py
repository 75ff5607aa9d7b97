"""Benchmark: a two-rank CPU run with its threads under SCHED_BATCH (the default on a CPU,
mp_train/loop/cpu_scheduling.py), against the same run with --no-cpu-batch-scheduling.

Each run is apps/gpt's pretrain of configs/tiny.yaml on mock data under torchrun, two
ranks over gloo, 30 iterations logged every 10; a run's figure is its mean ms/iteration
over iterations 11-30 (the first interval, with its warm-up, left out). The two sides take
turns --rounds times, the order flipped every round. Layouts: DP2 (one bucketed gradient
all-reduce a step), TP2 (a few small all-reduces per layer) and TP2 at micro-batch 1
(eight times as many steps' worth of collectives per sample). Each JSON line gives the
best and the median of both sides and the ratio of the medians.

    uv run python ci/bench/bench_cpu_scheduling.py [--rounds 3]

Run it from a shell under the default policy: a caller under SCHED_BATCH (chrt) hands it
to both sides.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import context, emit

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "dp2": [],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-micro-batch-1": ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"],
}
SIDES = {"batch": [], "default policy": ["--no-cpu-batch-scheduling"]}
_LINE = re.compile(r"^iteration +(\d+) \|.*\| ms/iteration ([\d.]+) \|", re.MULTILINE)


def run_ms(layout: list[str], side: list[str]) -> float:
    """Mean ms/iteration over iterations 11-30 of one torchrun run."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--log-dir", str(Path(folder, "logs")), "-m", "mp_gpt.pretrain",
            "--config", str(ROOT / "apps/gpt/configs/tiny.yaml"), "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--train-iters", "30",
            "--log-interval", "10", "--eval-interval", "none", "--save", "none", "--load",
            "none", "--tensorboard-dir", "none", "--num-workers", "0", "--peak-tflops", "1",
            *layout, *side,
        ]  # fmt: skip
        env = {**os.environ, "MP_RUN_DIR": folder, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr}")
    found = [float(ms) for it, ms in _LINE.findall(done.stdout + done.stderr) if int(it) > 10]
    if len(found) != 2:
        raise RuntimeError(f"expected 2 log lines after iteration 10, found {len(found)}")
    return statistics.fmean(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    if hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) != os.SCHED_OTHER:
        sys.exit("run this under the default scheduling policy: both sides would inherit yours")

    ctx = context()
    for layout in args.layouts:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        order = list(SIDES.items())
        for _ in range(args.rounds):
            for side, flags in order:
                times[side].append(run_ms(LAYOUTS[layout], flags))
            order.reverse()
        ours, base = times["batch"], times["default policy"]
        emit(f"ms/iteration, {layout}, two CPU ranks over gloo", {
            "best_ms": round(min(ours), 1),
            "median_ms": round(statistics.median(ours), 1),
            "baseline": "--no-cpu-batch-scheduling",
            "baseline_best_ms": round(min(base), 1),
            "baseline_median_ms": round(statistics.median(base), 1),
            "speedup_median": round(statistics.median(base) / statistics.median(ours), 2),
            "rounds": args.rounds,
        }, ctx)  # fmt: skip


if __name__ == "__main__":
    main()
