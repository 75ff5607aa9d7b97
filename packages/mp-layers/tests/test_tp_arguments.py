"""Invalid arguments to the tensor-parallel layers raise ValueError naming them.

Validation happens before any communication, so a RankGroup without a
process group stands in for a TP group of four ranks.
"""

import pytest
import torch

from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    tensor_parallel_dropout,
    vocab_parallel_cross_entropy,
)
from mp_state import RankGroup, RNGStatesTracker

TP4 = RankGroup("tp", (0, 1, 2, 3), 0, None)
init = torch.nn.init.zeros_


def test_sizes_not_divisible_by_tp_are_refused():
    with pytest.raises(ValueError, match=r"output_size=10 .* tp group \(4\)"):
        ColumnParallelLinear(8, 10, tp_group=TP4, init_method=init)
    with pytest.raises(ValueError, match="input_size=6"):
        RowParallelLinear(6, 8, tp_group=TP4, init_method=init)
    with pytest.raises(ValueError, match="num_embeddings=50257"):
        VocabParallelEmbedding(50257, 8, tp_group=TP4, init_method=init)
    with pytest.raises(ValueError, match="hidden=7"):
        divide(7, TP4, "hidden")


def test_non_positive_sizes_are_refused():
    with pytest.raises(ValueError, match="input_size=0"):
        ColumnParallelLinear(0, 8, tp_group=TP4, init_method=init)
    with pytest.raises(ValueError, match="output_size=-4"):
        RowParallelLinear(8, -4, tp_group=TP4, init_method=init)
    with pytest.raises(ValueError, match="embedding_dim=0"):
        VocabParallelEmbedding(8, 0, tp_group=TP4, init_method=init)


def test_sequence_parallel_row_layer_needs_a_parallel_input():
    with pytest.raises(ValueError, match="input_is_parallel=True"):
        RowParallelLinear(
            8, 8, tp_group=TP4, input_is_parallel=False, sequence_parallel=True, init_method=init
        )


def test_cross_entropy_arguments():
    logits, target = torch.zeros(4, 2, 8), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"label_smoothing=1\.0"):
        vocab_parallel_cross_entropy(logits, target, TP4, label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"target.shape=\(4, 3\)"):
        vocab_parallel_cross_entropy(logits, torch.zeros(4, 3, dtype=torch.long), TP4)


def test_dropout_probability():
    with pytest.raises(ValueError, match=r"p=1\.5"):
        tensor_parallel_dropout(torch.ones(3), 1.5, RNGStatesTracker())
