"""Tensor- and sequence-parallel primitives (Megatron's semantics).

Shapes: [s, b, h] = sequence, batch, hidden; x/tp = split over the TP ranks.

    mappings.py          autograd collectives: copy/reduce/scatter/gather for TP
                         (last dim) and SP (first dim)
    collectives.py       the same collectives without autograd
    column_parallel.py   ColumnParallelLinear: weight [out/tp, in]
    row_parallel.py      RowParallelLinear: weight [out, in/tp]
    vocab_parallel.py    VocabParallelEmbedding: weight [v/tp, h]
    cross_entropy.py     vocab_parallel_cross_entropy on [s, b, v/tp] logits
    fused_cross_entropy.py   its two passes over the logits compiled (fused=True)
    chunked_output_loss.py   chunked_linear_cross_entropy: the output layer's matmul and
                         that loss a chunk of tokens at a time, no [s, b, v/tp] logits
    data.py              broadcast_data from TP rank 0
    initialization.py    the full weight on every rank, each keeps its slice
    dropout.py           dropout on sharded activations (the TP random stream)
    sequence_parallel_grads.py   summing the gradients of SP-replicated parameters
    replicated.py        the sharding description of parameters whole on every rank
    partition.py         divide and ranges, with errors that name the argument

Every layer and function takes the group it communicates over (an
mp_state.RankGroup such as `state.tp`) and handles a group of one rank itself.
"""

from mp_layers.tensor_parallel.chunked_output_loss import chunked_linear_cross_entropy
from mp_layers.tensor_parallel.column_parallel import ColumnParallelLinear
from mp_layers.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mp_layers.tensor_parallel.data import broadcast_data
from mp_layers.tensor_parallel.dropout import tensor_parallel_dropout
from mp_layers.tensor_parallel.initialization import (
    InitMethod,
    building_on,
    init_partitioned_weight,
    row_sharded_parameter,
    skipping_draws,
)
from mp_layers.tensor_parallel.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sum_over_tensor_model_parallel_region,
)
from mp_layers.tensor_parallel.partition import divide
from mp_layers.tensor_parallel.replicated import replicated_state_dict
from mp_layers.tensor_parallel.row_parallel import RowParallelLinear
from mp_layers.tensor_parallel.sequence_parallel_grads import all_reduce_sequence_parallel_grads
from mp_layers.tensor_parallel.vocab_parallel import VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "InitMethod",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_reduce_sequence_parallel_grads",
    "broadcast_data",
    "building_on",
    "chunked_linear_cross_entropy",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "init_partitioned_weight",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "replicated_state_dict",
    "row_sharded_parameter",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "skipping_draws",
    "sum_over_tensor_model_parallel_region",
    "tensor_parallel_dropout",
    "vocab_parallel_cross_entropy",
]
