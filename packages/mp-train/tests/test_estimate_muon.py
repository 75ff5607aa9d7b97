"""`estimate`'s weights and optimizer state under --optimizer muon, by hand-worked figures:
Muon's momentum (4 bytes) on the matrices, Adam's two moments (8) on the embedding, the
layer-wise distributed optimizer's split over the data-parallel ranks. test_estimate.py's
base model: 107136 parameters, of which the (tied) embedding 64 x 128 = 8192."""

from __future__ import annotations

import pytest

from mp_data import DataConfig
from mp_layers import TransformerConfig
from mp_optim import OptimizerConfig
from mp_state import ParallelConfig
from mp_train.configuration.config import GPTConfig, RunConfig, TrainingConfig
from mp_train.estimate import estimate

MB = 2**20
PARAMETERS, EMBEDDING = 107136, 8192


def make_config(**optimizer) -> RunConfig:
    return RunConfig(
        model=TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                add_bias_linear=False, position_embedding_type="rope",
                                bf16=True),
        parallel=ParallelConfig(), gpt=GPTConfig(seq_length=32),
        optimizer=OptimizerConfig(bf16=True, optimizer="muon", **optimizer),
        data=DataConfig(vocab_size=100),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=8),
    )  # fmt: skip


def test_muon_keeps_one_moment_on_the_matrices():
    result = estimate(make_config(), world_size=1)
    # bf16 weight 2 + fp32 gradient 4 + fp32 main weight 4 + momentum 4 = 14 bytes,
    # and Adam's second moment (4 more) on the embedding
    assert result["bytes_per_parameter"] == 14
    want = PARAMETERS * 14 + EMBEDDING * 4
    assert result["weight_and_optimizer_mb"] == pytest.approx(want / MB)


def test_the_layer_wise_optimizer_splits_the_state():
    config = make_config(use_distributed_optimizer=True)
    assert config.optimizer.use_layer_wise_distributed_optimizer
    result = estimate(config, world_size=4)  # dp 4: main weight and moments / 4
    want = PARAMETERS * (2 + 4 + 8 / 4) + EMBEDDING * 4 / 4
    assert result["weight_and_optimizer_mb"] == pytest.approx(want / MB)
