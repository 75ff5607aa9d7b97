"""The estimate under --step-batch-size-schedule: its iteration is the run's first
(Megatron's report at start-up); the loop scales the logged FLOPs of later, larger
batches by their size."""

from __future__ import annotations

from mp_data import DataConfig
from mp_layers import TransformerConfig
from mp_optim import OptimizerConfig
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate


def config(**training) -> RunConfig:
    return RunConfig(
        model=TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4),
        gpt=GPTConfig(seq_length=32), optimizer=OptimizerConfig(),
        data=DataConfig(vocab_size=100), training=TrainingConfig(micro_batch_size=2, **training),
    )  # fmt: skip


def test_a_step_batch_schedule_is_estimated_at_its_first_batch():
    fixed = estimate(config(global_batch_size=8), world_size=1)
    stepped = estimate(config(step_batch_size_schedule="0:8 1M:16"), world_size=1)
    assert (stepped["global_batch_size"], stepped["num_microbatches"]) == (8, 4)
    assert stepped["flops_per_iteration"] == fixed["flops_per_iteration"]
