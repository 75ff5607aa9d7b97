"""Benchmark: how long `mp-ckpt --help` and `mp-data --help` take to answer.

Each command runs --repeats times as a user runs it (the console script beside
this interpreter, a new process each time); the baseline, measured in the same
run, is the bare interpreter (`python -c pass`). Each JSON line gives the best
and the median, their ratio to the baseline's, and whether importing the
command's module imports torch. Target: under 1 s each, without torch.

    uv run python ci/bench/bench_cli_help.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import context, emit

COMMANDS = {"mp-ckpt": "mp_ckpt.cli", "mp-data": "mp_data.cli"}
"""Console script -> the module it imports before parsing its arguments."""


def timings(command: list[str], repeats: int) -> list[float]:
    """Wall seconds of `repeats` runs of command, each a new process; raises if one fails."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, check=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()

    ctx = context()
    bare = timings([sys.executable, "-c", "pass"], args.repeats)
    for script, module in COMMANDS.items():
        found = timings([str(Path(sys.executable).parent / script), "--help"], args.repeats)
        figures = {
            "best_s": round(min(found), 3),
            "median_s": round(statistics.median(found), 3),
            "baseline": "python -c pass",
            "baseline_best_s": round(min(bare), 3),
            "baseline_median_s": round(statistics.median(bare), 3),
            "ratio_median": round(statistics.median(found) / statistics.median(bare), 2),
            "repeats": args.repeats,
            "imports_torch": imports_torch(module),
        }
        emit(f"{script} --help", figures, ctx)


if __name__ == "__main__":
    main()
