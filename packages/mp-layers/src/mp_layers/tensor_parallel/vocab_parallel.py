"""VocabParallelEmbedding: a word embedding whose vocabulary is split over TP ranks.

Shapes: [s, b] token ids, [s, b, h] embeddings (sequence, batch, hidden);
v = vocabulary size; x/tp is this rank's piece of x.

    weight  [v/tp, h]         rank r holds token ids r*v/tp .. (r+1)*v/tp
    input   [s, b]            token ids (any shape without sequence_parallel)
    output  [s, b, h]         all-reduced
            [s/tp, b, h]      with sequence_parallel: reduce-scattered along s

Each rank looks up the ids in its own range and writes zeros for the others;
since every id lies in exactly one rank's range, the sum over the group is
the full lookup. Under sequence parallelism that sum is a reduce-scatter
along s, which hands the next (sequence-parallel) layer its piece directly,
as Megatron's embedding does with `reduce_scatter_embeddings`.

The vocabulary size must divide by tp: pad it first, as Megatron does
(make-vocab-size-divisible-by).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.tensor_parallel.deferred_init import weight_device
from mp_layers.tensor_parallel.initialization import InitMethod, init_partitioned_weight
from mp_layers.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mp_layers.tensor_parallel.partition import divide, partition_range
from mp_state import RankGroup

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding table split along the vocabulary over `tp_group`.

    The weight is initialized as in `initialization`: the same seed gives the
    same global table at any tensor-parallel size.

    Arguments:
        num_embeddings: v, the (padded) vocabulary size; divisible by tp_group.size.
        embedding_dim: h, the hidden size.
        tp_group: the tensor-parallel group (e.g. `state.tp`).
        init_method: fills the full [v, h] table in place.
        sequence_parallel: ids are [s, b]; the output is reduce-scattered to [s/tp, b, h].
        params_dtype: dtype of the weight.
        device: device of the weight (default: torch's default device).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: RankGroup,
        init_method: InitMethod,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings_per_partition = divide(num_embeddings, tp_group, "num_embeddings")
        if (
            isinstance(embedding_dim, bool)
            or not isinstance(embedding_dim, int)
            or embedding_dim <= 0
        ):
            raise ValueError(f"embedding_dim={embedding_dim!r} must be a positive integer")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.vocab_start_index, self.vocab_end_index = partition_range(
            self.num_embeddings_per_partition, tp_group.rank
        )
        self.weight = torch.nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=params_dtype,
                device=weight_device(device),
            )
        )
        init_partitioned_weight(
            self.weight, (num_embeddings, embedding_dim), 0, tp_group, init_method
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[s, b] ids -> [s, b, h] (or [s/tp, b, h] with sequence_parallel)."""
        if self.tp_group.size > 1:
            outside = (input < self.vocab_start_index) | (input >= self.vocab_end_index)
            # Any in-range index will do for the lookup: its row is zeroed below.
            local_ids = (input - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local_ids, self.weight)
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(input, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """weight, split along the vocabulary (its first axis) over the TP ranks."""
        key = f"{prefix}weight"
        rank, size = self.tp_group.rank, self.tp_group.size
        return {key: ShardedTensor.from_rank(key, self.weight, 0, rank, size)}

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp={self.tp_group.size}, sequence_parallel={self.sequence_parallel}"
        )
