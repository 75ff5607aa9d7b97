"""What every benchmark prints beside its figures: machine, command, commit, date.

Each benchmark prints one JSON line per measure: its figures, the baseline
measured in the same run, their ratio, and `context()`.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LLAMA_SHAPE",
    "LlamaShape",
    "best_of",
    "context",
    "emit",
    "llama_flags",
    "peak_rss",
    "reset_peak_rss",
    "status_mib",
    "take_turns",
]

LLAMA_SHAPE = (512, 8, 8, 4, 64, 1376, 32000)
"""The ~56M-parameter Llama-style model of bench_layers.py and bench_gpt.py: hidden,
layers, heads, query groups, head channels, ffn, vocabulary."""


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style model: GQA, RMSNorm (eps 1e-6), SwiGLU, RoPE (theta 10,000), no
    biases, dropout 0; its embeddings untied unless `tied`."""

    hidden: int
    layers: int
    heads: int
    query_groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    def flags(self) -> list[str]:
        """The shape as Megatron's model flags."""
        untie = [] if self.tied else ["--untie-embeddings-and-output-weights"]
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads), "--group-query-attention",
            "--num-query-groups", str(self.query_groups), "--kv-channels", str(self.head_dim),
            "--ffn-hidden-size", str(self.ffn), "--normalization", "RMSNorm",
            "--layernorm-epsilon", "1e-6", "--swiglu", "--use-rotary-position-embeddings",
            "--disable-bias-linear", *untie, "--hidden-dropout", "0", "--attention-dropout", "0",
        ]  # fmt: skip

    def hf_config(self, vocab: int, max_positions: int):
        """transformers' LlamaConfig of the shape over `vocab` ids (ours pads its
        vocabulary: the baseline gets the padded size), token ids 0, SDPA attention."""
        import transformers

        return transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.query_groups, head_dim=self.head_dim, rms_norm_eps=1e-6,
            rope_theta=10000.0, max_position_embeddings=max_positions,
            tie_word_embeddings=self.tied, attention_bias=False, mlp_bias=False,
            attention_dropout=0.0, initializer_range=0.02, bos_token_id=0, eos_token_id=0,
            pad_token_id=0, attn_implementation="sdpa",
        )  # fmt: skip


def llama_flags() -> list[str]:
    """LLAMA_SHAPE (untied embeddings) as Megatron's model flags."""
    return LlamaShape(*LLAMA_SHAPE).flags()


def context() -> dict[str, Any]:
    import numpy
    import torch

    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": numpy.__version__,
            "torch": torch.__version__,
        },
        "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def best_of(repeats: int, function: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """The fastest of `repeats` calls of function(*args), in seconds, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


def take_turns(steps: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict:
    """Seconds of each of `repeats` timed calls of every side on this rank: after `warmup`
    untimed calls each, the sides take turns, each call after a barrier of the default
    process group, the order flipped every round (so drift hits all sides alike)."""
    import torch.distributed as dist

    for function in steps.values():
        for _ in range(warmup):
            function()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for _ in range(repeats):
        for name, function in order:
            dist.barrier()
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
        order.reverse()
    return times


def emit(measure: str, figures: dict[str, Any], ctx: dict[str, Any]) -> None:
    print(json.dumps({"measure": measure, **figures, **ctx}), flush=True)


def _commit() -> str:
    def git(*command: str) -> str:
        try:
            done = subprocess.run(["git", *command], capture_output=True, text=True, check=False)
        except OSError:  # no git on this machine (a GPU box with the sources copied over)
            return ""
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


# Runs the command given as its arguments and prints the child's peak RSS (KiB).
# A separate small launcher, because a child started from a large process
# inherits its high-water RSS: Linux records the old memory map's peak into
# the child's maxrss when the child calls exec.
_PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=sys.stderr).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""


def peak_rss(command: list[str]) -> tuple[int, float]:
    """Peak RSS (KiB) of `command` run to completion, and its seconds; raises if it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, *command], capture_output=True,
                          text=True, check=False)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return int(done.stdout.split()[-1]), seconds


def reset_peak_rss() -> float:
    """Hands freed heap back (malloc_trim), resets this process's peak resident set
    (VmHWM, by `echo 5 > /proc/self/clear_refs`) and returns the resident set (MiB): a
    later status_mib("VmHWM") minus it is what was allocated since at the peak (Linux)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_mib("VmRSS")


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")
