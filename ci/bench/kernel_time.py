"""Where a profiled iteration's time goes: a torch profiler trace (chrome JSON
traceEvents) read by kind of kernel, for gpu_steps.profile (gpu_suite.py's profile step).

    kernel_time(events, gpu)   busy time by kind over the span, and the top 20 kernels
    kernel_kind(name)          the kind a kernel's name says (KERNEL_KINDS)
"""

from __future__ import annotations

from typing import Any

__all__ = ["KERNEL_KINDS", "kernel_kind", "kernel_time"]

KERNEL_KINDS = (
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "matmul", "aten::mm",
                "aten::addmm", "aten::bmm", "aten::linear", "scaled_mm", "mmbackward")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "nll_loss", "logsumexp")),
    ("compiled", ("triton", "torch-compiled", "compiledfunction")),
    ("copies", ("memcpy", "memset", "copy_", "aten::to", "aten::_to_copy")),
)  # fmt: skip
"""Kinds of kernel by what their names contain (the first kind that matches); the rest
are 'elementwise and other'."""


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)),
                "elementwise and other")  # fmt: skip


def kernel_time(events: list[dict], gpu: bool) -> dict[str, Any]:
    """A profiler trace's (chrome JSON traceEvents) busy time by kind over the span of the
    profiled work, and the 20 kernels with the most time. On a GPU the kernels,
    copies and memsets; on the CPU the top-level operators of each thread (an operator
    inside another counts in its parent)."""
    if gpu:
        kernels = [e for e in events if e.get("ph") == "X"
                   and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]  # fmt: skip
    else:
        kernels = _top_level([e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"])
    if not kernels:
        raise RuntimeError("the trace holds no kernels")
    start = min(e["ts"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - start
    busy = sum(e["dur"] for e in kernels)
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        kind = kernel_kind(e["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
        by_name.setdefault(e["name"][:120], []).append(e["dur"])
    shares = {k: round(v / span, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    shares["idle"] = round(max(span - busy, 0.0) / span, 4)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    return {
        "iteration_ms": round(span / 1000, 3), "busy_ms": round(busy / 1000, 3),
        "kernels": len(kernels), "share_of_iteration": shares,
        "top_kernels": [{"name": name, "kind": kernel_kind(name), "calls": len(d),
                         "ms": round(sum(d) / 1000, 3)} for name, d in top],
    }  # fmt: skip


def _top_level(ops: list[dict]) -> list[dict]:
    """The operators not inside another one of their thread."""
    kept, ends = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= ends.get(thread, float("-inf")):
            kept.append(e)
            ends[thread] = e["ts"] + e["dur"]
    return kept
