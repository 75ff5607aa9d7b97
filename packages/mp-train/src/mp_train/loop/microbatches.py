"""How many micro-batches make this iteration's global batch (Megatron's calculator).

Constant: global_batch_size / (micro_batch_size x dp). With
rampup_batch_size = [start, increment, ramp_samples] the global batch starts
at `start` and grows by `increment` every ramp_samples / ((global - start) /
increment) consumed samples, reaching global_batch_size once ramp_samples
are consumed. Every size must be a multiple of micro_batch_size x dp.

With step_batch_size_schedule ("0:384 200B:768 400B:1152", Megatron-LM's): from each
threshold of consumed tokens on (K, M, B, T: 1e3 .. 1e12; tokens / seq_length samples,
rounded down) the global batch is that entry's. A size must be a multiple of
micro_batch_size x dp when it is used, not before (a run resumed at a larger layout may
have left sizes that no longer divide behind it).
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_train.configuration.batch_sizes import parse_batch_schedule

__all__ = ["MicroBatchCalculator", "parse_batch_schedule"]


@dataclass
class MicroBatchCalculator:
    global_batch_size: int
    """The global batch; with a schedule, its largest (for the sample counts)."""
    micro_batch_size: int
    data_parallel_size: int
    rampup_batch_size: list[int] | None = None
    schedule: list[tuple[int, int]] | None = None
    """parse_batch_schedule's entries."""
    requested_global_batch_size: int | None = None
    """The global batch asked for, when decrease_batch_size_if_needed trains with a smaller
    global_batch_size; None: the same."""

    @property
    def shortfall(self) -> int:
        """Samples per iteration below the batch asked for (decrease_batch_size_if_needed):
        counted as skipped, as Megatron counts them."""
        requested = self.requested_global_batch_size
        return 0 if requested is None else requested - self.global_batch_size

    def __post_init__(self) -> None:
        self.per_microbatch = self.micro_batch_size * self.data_parallel_size
        if self.schedule is not None:
            self.global_batch_size = max(size for _, size in self.schedule)
            return
        if self.global_batch_size % self.per_microbatch:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size={self.micro_batch_size} x "
                f"data_parallel_size={self.data_parallel_size}"
            )
        if self.rampup_batch_size is None:
            return
        start, increment, ramp_samples = self.rampup_batch_size
        if start < 1 or increment < 1 or ramp_samples < 0:
            raise ValueError(f"rampup_batch_size={self.rampup_batch_size}: all must be positive")
        span = self.global_batch_size - start
        if span < 0 or span % increment:
            raise ValueError(
                f"rampup_batch_size={self.rampup_batch_size}: global_batch_size="
                f"{self.global_batch_size} minus the start {start} must be a non-negative "
                f"multiple of the increment {increment}"
            )
        for size in range(start, self.global_batch_size + 1, increment):
            if size % self.per_microbatch:
                raise ValueError(
                    f"rampup_batch_size={self.rampup_batch_size}: the global batch {size} is "
                    f"not divisible by micro_batch_size x data_parallel_size = "
                    f"{self.per_microbatch}"
                )
        self._samples_per_increment = ramp_samples / (span // increment) if span else 0.0

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch size after `consumed_samples` training samples."""
        if self.schedule is not None:
            return [size for start, size in self.schedule if consumed_samples >= start][-1]
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples > ramp_samples or not self._samples_per_increment:
            return self.global_batch_size
        steps = int(consumed_samples / self._samples_per_increment)
        return min(start + steps * increment, self.global_batch_size)

    def num_microbatches(self, consumed_samples: int) -> int:
        size = self.global_batch(consumed_samples)
        if size % self.per_microbatch:
            start = next(s for s, n in reversed(self.schedule or []) if consumed_samples >= s)
            raise ValueError(
                f"step_batch_size_schedule: the global batch {size} from sample {start} on "
                f"(consumed: {consumed_samples}) is not divisible by micro_batch_size="
                f"{self.micro_batch_size} x data_parallel_size={self.data_parallel_size}"
            )
        return size // self.per_microbatch

    def samples_for(self, iterations: int) -> int:
        """The training samples `iterations` iterations from the start consume (at most,
        under a ramp-up: the final batch's)."""
        if self.schedule is None:
            return iterations * self.global_batch_size
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch(consumed)
        return consumed
