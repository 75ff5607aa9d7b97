"""mp-layers: the model side of mp.

TransformerConfig, the tensor- and sequence-parallel primitives
(mp_layers.tensor_parallel), context parallelism (mp_layers.context_parallel:
the load-balanced sequence split and attention across it), mixture of experts
(mp_layers.moe: router, token dispatchers, grouped experts), the transformer
pieces (rotary embeddings, norms, core attention, MLP, self-attention, layer
and block in mp_layers.transformer), FP8 GEMMs through torchao (mp_layers.fp8),
ModelGroups and GPTModel.
"""

from mp_layers import (
    context_parallel,
    moe,
    qk_clip,
    tensor_parallel,
)
from mp_layers.config import TransformerConfig
from mp_layers.config_attention import kv_heads_per_rank
from mp_layers.config_dsa import dsa_choice_source, shares_dsa_choice
from mp_layers.config_hybrid import (
    hybrid_layer_kinds,
    hybrid_pipeline_segments,
    mamba_widths,
    split_hybrid_pattern,
)
from mp_layers.config_linear_attention import linear_attention_layer_pattern
from mp_layers.config_moe import balancing_losses
from mp_layers.config_mtp import mtp_layer_kinds
from mp_layers.context_parallel import shard_sequence
from mp_layers.fp8 import check_fp8_device
from mp_layers.gpt_model import GPTModel
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_sequence_parallel_grads,
    broadcast_data,
    building_on,
    chunked_linear_cross_entropy,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    init_partitioned_weight,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    skipping_draws,
    tensor_parallel_dropout,
    vocab_parallel_cross_entropy,
)
from mp_layers.transformer.blocked_attention import saved_probability_bytes
from mp_layers.transformer.compiled import compile_layers
from mp_layers.transformer.core_attention import keeps_attention_probabilities
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.layer import TransformerLayer
from mp_layers.transformer.layer_hooks import on_layer_built
from mp_layers.transformer.mamba_layer import MambaLayer
from mp_layers.transformer.mamba_mixer import CONV_WIDTH, SCAN_CHUNK, MambaMixer
from mp_layers.transformer.multi_token_prediction import MultiTokenPrediction
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.sparse_attention import LightningIndexer
from mp_layers.transformer.spec import LOCAL_SPEC, LayerSpec, get_layer_spec

__all__ = [
    "CONV_WIDTH",
    "LOCAL_SPEC",
    "SCAN_CHUNK",
    "ColumnParallelLinear",
    "GPTModel",
    "InitMethod",
    "KVCache",
    "LayerSpec",
    "LightningIndexer",
    "MambaLayer",
    "MambaMixer",
    "ModelGroups",
    "MultiTokenPrediction",
    "PackedSeqParams",
    "RowParallelLinear",
    "TransformerConfig",
    "TransformerLayer",
    "VocabParallelEmbedding",
    "all_reduce_sequence_parallel_grads",
    "balancing_losses",
    "broadcast_data",
    "building_on",
    "check_fp8_device",
    "chunked_linear_cross_entropy",
    "compile_layers",
    "context_parallel",
    "copy_to_tensor_model_parallel_region",
    "dsa_choice_source",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_layer_spec",
    "hybrid_layer_kinds",
    "hybrid_pipeline_segments",
    "init_partitioned_weight",
    "keeps_attention_probabilities",
    "kv_heads_per_rank",
    "linear_attention_layer_pattern",
    "mamba_widths",
    "moe",
    "mtp_layer_kinds",
    "on_layer_built",
    "qk_clip",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "saved_probability_bytes",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "shard_sequence",
    "shares_dsa_choice",
    "skipping_draws",
    "split_hybrid_pattern",
    "tensor_parallel",
    "tensor_parallel_dropout",
    "vocab_parallel_cross_entropy",
]
