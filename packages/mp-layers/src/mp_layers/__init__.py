"""mp-layers: the model side of mp.

Today: TransformerConfig, the tensor- and sequence-parallel primitives
(mp_layers.tensor_parallel) and the first transformer pieces (rotary
embeddings, norms, core attention in mp_layers.transformer). The transformer
layer, block, layer specs and GPTModel follow.
"""

from mp_layers import tensor_parallel
from mp_layers.config import TransformerConfig
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    broadcast_data,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    init_partitioned_weight,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    tensor_parallel_dropout,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "InitMethod",
    "RowParallelLinear",
    "TransformerConfig",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "broadcast_data",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "init_partitioned_weight",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "tensor_parallel",
    "tensor_parallel_dropout",
    "vocab_parallel_cross_entropy",
]
