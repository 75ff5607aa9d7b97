"""RerunConfig: result validation by re-running an iteration (Megatron-LM's rerun engine
flags, --iterations-to-skip and the rejected-results tracker file), a base of
TrainingConfig. The loop's side is loop/rerun.py; docs/reliability.md tells the story."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["RerunConfig"]


@dataclass(kw_only=True)
class RerunConfig:
    rerun_mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    """validate_results (Megatron's default): a micro-batch loss that fails its check (nan
    or inf with check_for_nan_in_loss_and_grad, a spike with check_for_spiky_loss) from the
    job's second iteration on makes every rank run the iteration again, with the same data
    and random states, to tell a transient fault (another result: exit code 17) from a
    reproducible result (a fatal check: a checkpoint and exit code 16, for the job to be
    resumed on other hardware, whose rerun then decides between a persistent fault and a
    correct result, exit code 17). report_stats: every iteration runs twice and rank 0
    logs how far the two runs' losses differ. disabled: one run per iteration; a loss
    that fails its check stops the run (nan or inf) or is logged (a spike)."""

    error_injection_rate: int = 0
    """Make about one validated loss in this many fail its check (0: none), to test the
    rerun path (Megatron's --error-injection-rate)."""

    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = (
        "transient_error"
    )
    """What an injected failure behaves as when the iteration is run again: transient_error
    (the rerun disagrees), persistent_error (the rerun on this hardware agrees, the one on
    other hardware does not) or correct_result (every rerun agrees)."""

    check_for_spiky_loss: bool = False
    """Check each micro-batch's loss against 10 x the largest of the first 100 seen; a spike
    is run again and logged, never fatal."""

    result_rejected_tracker_filename: str | None = None
    """A file each rank appends a line to for every loss that failed its check and for each
    rerun's verdict (Megatron's format). At start-up, an iteration whose loss failed on the
    same rank twice (reproducibly, or with reruns disabled), and on no other rank of the
    same job, is added to iterations_to_skip."""

    iterations_to_skip: list[int] = field(default_factory=list)
    """Iterations (1-based) not trained: their global batch is read and dropped, and the
    run goes on with the next one (Megatron's --iterations-to-skip). The learning-rate
    schedule does not advance over them."""

    def __post_init__(self) -> None:
        if self.error_injection_rate < 0:
            raise ValueError(
                f"error_injection_rate={self.error_injection_rate} must be >= 0 (0: none)"
            )
        wrong = [i for i in self.iterations_to_skip if i < 1]
        if wrong:
            raise ValueError(f"iterations_to_skip={wrong}: iterations count from 1")
