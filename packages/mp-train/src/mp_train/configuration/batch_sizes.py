"""The batch sizes besides the constant global batch: Megatron-LM's
--step-batch-size-schedule ("0:384 200B:768 400B:1152" gives the global batch from each
threshold of consumed tokens on; loop/microbatches.py applies it), and the evaluation's
own batch (--eval-global-batch-size, --eval-micro-batch-size), checked against the
layout; and the global batch a run trains with under --decrease-batch-size-if-needed."""

from __future__ import annotations

import itertools

from mp_pipeline import check_microbatch_group

__all__ = ["batch_schedule", "check_eval_batch", "parse_batch_schedule", "running_global_batch"]

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


def check_eval_batch(training, gbs: int | None, dp: int, pp: int,
                      vpp: int | None) -> None:  # fmt: skip
    """The evaluation's batch (eval_micro_batch_size, eval_global_batch_size) fits the
    layout; `gbs`: the training's constant global batch (None under a schedule)."""
    mbs = training.eval_micro_batch_size
    size = training.eval_global_batch_size
    if mbs is None and size is None:
        return
    mbs = training.micro_batch_size if mbs is None else mbs
    if mbs < 1:
        raise ValueError(f"eval_micro_batch_size={mbs} must be >= 1")
    if size is None:
        if gbs is None or training.rampup_batch_size is not None:
            raise ValueError("eval_micro_batch_size with a global batch that changes "
                             "(rampup_batch_size, step_batch_size_schedule): give "
                             "eval_global_batch_size too")  # fmt: skip
        size, name = gbs, "the global batch"
    else:
        name = f"eval_global_batch_size={size}"
    if size < 1 or size % (mbs * dp):
        raise ValueError(f"{name} is not divisible by eval_micro_batch_size={mbs} x "
                         f"data_parallel_size={dp}")  # fmt: skip
    if vpp is not None:
        try:
            check_microbatch_group(size // (mbs * dp), pp, pp)
        except ValueError as error:
            raise ValueError(
                f"{error} (the evaluation's micro-batches: {size // (mbs * dp)} "
                f"= {name} / (eval_micro_batch_size {mbs} x dp {dp}))"
            ) from None


def batch_schedule(config) -> list[tuple[int, int]] | None:
    """step_batch_size_schedule's entries (samples, global batch), checked; None without."""
    training = config.training
    if training.step_batch_size_schedule is None:
        return None
    # Megatron-LM refuses the schedule beside --global-batch-size, and ignores
    # --rampup-batch-size (deprecated there); mp would ramp, so it refuses that pair too.
    megatron = {
        "global_batch_size": "Megatron-LM refuses the pair",
        "rampup_batch_size": "Megatron-LM ignores rampup_batch_size beside it",
    }
    for name, why in megatron.items():
        if getattr(training, name) is not None:
            raise ValueError(f"step_batch_size_schedule with {name}: the schedule gives the "
                             f"global batch; drop one ({why})")  # fmt: skip
    return parse_batch_schedule(training.step_batch_size_schedule, config.gpt.seq_length)


def running_global_batch(training, gbs: int, dp: int) -> int:
    """The global batch trained with: `gbs`, or under decrease_batch_size_if_needed the
    largest multiple of micro_batch_size x dp below it (Megatron's rule, for a run restarted
    on fewer data-parallel ranks; a layout that divides it again restores it)."""
    mbs = training.micro_batch_size
    if gbs % (mbs * dp) == 0:
        return gbs
    if not training.decrease_batch_size_if_needed:
        raise ValueError(
            f"global_batch_size={gbs} is not divisible by micro_batch_size={mbs} x "
            f"data_parallel_size={dp}"
        )
    running = gbs // (mbs * dp) * (mbs * dp)
    if running == 0:
        raise ValueError(
            f"decrease_batch_size_if_needed: global_batch_size={gbs} is below "
            f"micro_batch_size={mbs} x data_parallel_size={dp}"
        )
    return running
