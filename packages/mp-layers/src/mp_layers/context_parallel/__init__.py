"""Context parallelism: a sequence split across ranks (Megatron's load-balanced chunks) and
attention over the whole of it."""

from mp_layers.context_parallel.block_plan import dropout_keep, mixed_seed
from mp_layers.context_parallel.layout import (
    attention_blocks,
    local_chunks,
    local_positions,
    shard_sequence,
)
from mp_layers.context_parallel.ring_attention import (
    CP_COMM_TYPES,
    RingWaits,
    context_parallel_attention,
    timed_ring_waits,
)

__all__ = [
    "CP_COMM_TYPES",
    "RingWaits",
    "attention_blocks",
    "context_parallel_attention",
    "dropout_keep",
    "local_chunks",
    "local_positions",
    "mixed_seed",
    "shard_sequence",
    "timed_ring_waits",
]
