"""Which training samples the current phase reads (Megatron-LM's
--phase-transition-iterations): a phase's dataset holds the samples from its first
iteration to the next transition (or the end of training), and the loader starts at the
samples the phase has consumed, not the whole run's."""

from __future__ import annotations

__all__ = ["phase_samples"]


def phase_samples(
    transitions: tuple[int, ...], global_batch_size: int, total_samples: int, iteration: int
) -> tuple[int, int]:
    """(the samples of the phase that iteration `iteration` + 1 belongs to, the samples it
    has consumed by then), Megatron's count: in global batches from its start."""
    starts = [0, *(t * global_batch_size for t in transitions)]
    ends = [*starts[1:], total_samples]
    done = iteration * global_batch_size
    if starts[-1] >= total_samples:
        raise ValueError(
            f"phase_transition_iterations: the last phase would start at sample {starts[-1]}, "
            f"at or past the end of training ({total_samples}): each transition must come before"
        )
    start, end = next(
        (s, e) for s, e in zip(starts, ends, strict=True) if s <= done < e or e == ends[-1]
    )
    last = max(t for t in (0, *transitions) if t <= iteration)
    return end - start, (iteration - last) * global_batch_size
