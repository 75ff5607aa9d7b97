"""How many micro-batches make this iteration's global batch (Megatron's calculator).

Constant: global_batch_size / (micro_batch_size x dp). With
rampup_batch_size = [start, increment, ramp_samples] the global batch starts
at `start` and grows by `increment` every ramp_samples / ((global - start) /
increment) consumed samples, reaching global_batch_size once ramp_samples
are consumed. Every size must be a multiple of micro_batch_size x dp.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MicroBatchCalculator"]


@dataclass
class MicroBatchCalculator:
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup_batch_size: list[int] | None = None

    def __post_init__(self) -> None:
        self.per_microbatch = self.micro_batch_size * self.data_parallel_size
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
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples > ramp_samples or not self._samples_per_increment:
            return self.global_batch_size
        steps = int(consumed_samples / self._samples_per_increment)
        return min(start + steps * increment, self.global_batch_size)

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.global_batch(consumed_samples) // self.per_microbatch
