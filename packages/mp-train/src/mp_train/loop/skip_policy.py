"""What an iteration does with a loss that is not finite, and the count of iterations that
left the parameters as they were (Megatron's check_for_nan_in_loss_and_grad and the
`skipped iterations` / `nan iterations` of its log).

- check_for_nan_in_loss_and_grad (the default): a nan or inf loss on any rank stops the
  run with a FloatingPointError naming the rank, its losses and the iteration;
- skip_nan_loss_iterations: such an iteration takes no optimizer step instead; it counts
  as a nan iteration and as a skipped one;
- neither: the loss is not looked at;
- an optimizer step that did not update (the fp16 loss scaler found inf or nan gradients)
  counts as skipped. The scheduler advances only on an update.

The check is collective (a MAX all-reduce over every rank of one flag), so every rank
skips the same iterations; ranks that compute no loss (pipeline stages before the last)
learn from the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.distributed as dist

from mp_train.configuration.config import TrainingConfig
from mp_train.loop.any_rank import any_rank
from mp_train.loop.setup import TrainState

__all__ = ["SkipPolicy"]


class SkipPolicy:
    """`counters`: the run's TrainState, whose nan_iterations and skipped_iterations it
    counts. `any_rank(flag)`: whether any rank's flag is set (collective; by default an
    all-reduce over the default group)."""

    def __init__(self, training: TrainingConfig, counters: TrainState,
                 any_rank: Callable[[bool], bool] | None = None) -> None:  # fmt: skip
        self.skips = training.skip_nan_loss_iterations
        self.checks = training.check_for_nan_in_loss_and_grad or self.skips
        self.counters = counters
        self.any_rank = _any_rank if any_rank is None else any_rank

    def takes_step(self, losses: dict[str, float], iteration: int) -> bool:
        """Whether iteration `iteration` (the one being run) steps the optimizer, given this
        rank's losses (empty off the last pipeline stage). Collective when checking."""
        if not self.checks:
            return True
        if not self.any_rank(any(not math.isfinite(v) for v in losses.values())):
            return True
        if not self.skips:
            rank = dist.get_rank() if dist.is_initialized() else 0
            where = (
                f"rank {rank}: loss {losses}"
                if losses
                else f"rank {rank}: a rank of the last pipeline stage saw a loss"
            )
            raise FloatingPointError(
                f"{where} is nan or inf at iteration {iteration} "
                "(skip_nan_loss_iterations skips such iterations instead)"
            )
        self.counters.nan_iterations += 1
        return False

    def updated(self, result) -> bool:
        """Whether the iteration updated the parameters: `result` is the optimizer step's
        (None when takes_step said no). An iteration that did not is counted as skipped."""
        if result is not None and result.update_successful:
            return True
        self.counters.skipped_iterations += 1
        return False


def _any_rank(flag: bool) -> bool:
    return any_rank([flag])[0]
