"""TensorBoard scalars under Megatron-LM's tag names, steps and cadence (last rank).

Every tensorboard_log_interval iterations, each the iteration's own value,
against the iteration and, as `<tag> vs samples`, against the consumed
samples: `learning-rate`, `batch-size`, each reported loss (`lm loss`),
`loss-scale`, `world-size` (log_world_size_to_tensorboard), `grad-norm`,
`mtp-grad-norm` (with mtp_detach_heads: the multi-token prediction modules' own norm,
which grad-norm leaves out), `num-zeros` (log_num_zeros_in_grad), `params-norm`
(log_params_norm). With
log_memory_to_tensorboard, against the iteration only: `mem-reserved-bytes`,
`mem-allocated-bytes`, `mem-max-allocated-bytes`, `mem-allocated-count`.

Every iteration, against it (Megatron's MoE metrics tracker): the MoE
auxiliary losses `load_balancing_loss` or `seq_load_balancing_loss`, `z_loss`,
and with moe_per_layer_logging each layer's, `moe/<name>_layer_<i>`.

Every log_interval with log_timers_to_tensorboard, averaged over the
interval: `iteration-time` (s), `throughput` (TFLOP/s per rank, with
log_throughput), `<timer>-time` (s per iteration, the slowest rank's) for the
timers of timing_log_level.

Each evaluation: `<name> validation` and, with
log_validation_ppl_to_tensorboard, `<name> validation ppl` (exp(min(20, v))),
each also `vs samples`. The test split's evaluation, at the end: `<name> test` (and
`<name> test ppl`), where Megatron-LM writes it under the validation tags, at the step of
the final validation.

Tags whose switch is off or whose value does not exist (no grad norm on a
skipped step) are not written. With wandb_project the same tags, without the
`vs samples` series, go to Weights & Biases against the iteration.
"""

from __future__ import annotations

import math

from mp_train.configuration.config import LoggingConfig

__all__ = ["TensorBoard"]


class TensorBoard:
    """The run's TensorBoard writer (and W&B run); a no-op on ranks without them."""

    def __init__(self, config: LoggingConfig, last_rank: bool, wandb_run=None) -> None:
        self.config = config
        self.writer = None
        if last_rank and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=config.tensorboard_dir,
                                        max_queue=config.tensorboard_queue_size)  # fmt: skip
        self.wandb = wandb_run

    def writes_iteration(self, iteration: int) -> bool:
        """Whether the per-iteration scalars are written after this iteration (alike on
        every rank, so that ranks can compute a collective value only then)."""
        wanted = self.config.tensorboard_dir or self.config.wandb_project
        return bool(wanted) and iteration % self.config.tensorboard_log_interval == 0

    def add(self, iteration: int, values: dict[str, float],
            consumed_samples: int | None = None) -> None:  # fmt: skip
        """`values` against the iteration and, given consumed_samples, each also as
        `<tag> vs samples` against them."""
        for tag, value in values.items():
            if self.writer is not None:
                self.writer.add_scalar(tag, value, iteration)
                if consumed_samples is not None:
                    self.writer.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self.wandb is not None and values:
            self.wandb.log(dict(values), step=iteration)

    def validation(self, results: dict[str, float], iteration: int, consumed_samples: int,
                   suffix: str = "", split: str = "validation") -> None:  # fmt: skip
        """`<name> validation<suffix>` (and its perplexity, exp(min(20, value)), as
        Megatron; suffix "-<set>" with multiple_validation_sets); split "test": the test
        split's, `<name> test`."""
        values = {}
        for name, value in results.items():
            values[f"{name} {split}{suffix}"] = value
            if self.config.log_validation_ppl_to_tensorboard:
                values[f"{name} {split}{suffix} ppl"] = math.exp(min(20.0, value))
        self.add(iteration, values, consumed_samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
