"""Megatron-LM's --step-batch-size-schedule: "0:384 200B:768 400B:1152" gives the global
batch from each threshold of consumed tokens on (loop/microbatches.py applies it)."""

from __future__ import annotations

import itertools

__all__ = ["parse_batch_schedule"]

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str, schedule: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    if scale != 1:
        text = text[:-1]
    try:
        return int(float(text) * scale)
    except ValueError:
        raise ValueError(f"step_batch_size_schedule={schedule!r}: {text!r} is not a "
                         "number (with an optional K, M, B or T)") from None  # fmt: skip


def parse_batch_schedule(schedule: str, seq_length: int) -> list[tuple[int, int]]:
    """[(the consumed samples from which it holds, the global batch size)], by threshold;
    a ValueError names what is wrong (Megatron-LM's rules: the first threshold 0, strictly
    increasing thresholds, positive sizes)."""
    entries = []
    for entry in schedule.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"step_batch_size_schedule={schedule!r}: {entry!r} is not "
                             "THRESHOLD:BATCH_SIZE")  # fmt: skip
        tokens, size = entry.split(":", 1)
        entries.append((_number(tokens, schedule) // seq_length, _number(size, schedule)))
    entries.sort()
    if not entries or entries[0][0] != 0:
        raise ValueError(f"step_batch_size_schedule={schedule!r}: the first threshold must "
                         "be 0 (the batch size of the run's start)")  # fmt: skip
    for (before, _), (after, _) in itertools.pairwise(entries):
        if after <= before:
            raise ValueError(f"step_batch_size_schedule={schedule!r}: the thresholds must "
                             f"increase ({before} and {after} samples of {seq_length} "
                             "tokens)")  # fmt: skip
    if any(size < 1 for _, size in entries):
        raise ValueError(f"step_batch_size_schedule={schedule!r}: batch sizes must be >= 1")
    return entries
