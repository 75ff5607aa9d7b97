"""RowParallelLinear: Y = X A^T + b with A split by columns (input features).

Shapes: [s, b, h] = sequence, batch, hidden; x/tp is this rank's piece of x.

    weight  [out, in/tp]      rank r holds input features r*in/tp .. (r+1)*in/tp
    bias    [out]             whole on every TP rank (a replica)
    input   [s, b, in/tp]     input_is_parallel (the output of a ColumnParallelLinear)
            [s, b, in]        otherwise; this rank keeps its piece of the last dimension
    output  [s, b, out]       all-reduced
            [s/tp, b, out]    with sequence_parallel: reduce-scattered along s

Each rank multiplies its input features by its columns of A, giving a partial
sum of the output; the partial sums are all-reduced (or reduce-scattered
along the sequence) and the bias is added once, after the reduction.

With sequence parallelism each rank adds the bias to its own piece of the
sequence only, so its bias gradient covers that piece only: the gradient must
be summed over the TP group before the optimizer step. The bias is marked
`sequence_parallel = True` (Megatron's attribute, as on layer-norm weights
in sequence-parallel regions) and `all_reduce_sequence_parallel_grads` does
the sum.
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
    scatter_to_tensor_model_parallel_region,
)
from mp_layers.tensor_parallel.partition import divide, mark_partitioned
from mp_state import RankGroup

__all__ = ["RowParallelLinear"]


class RowParallelLinear(torch.nn.Module):
    """A linear layer whose input features are split over `tp_group`.

    forward(input) returns (output, bias): bias is None unless skip_bias_add,
    in which case the bias [out] is not added but returned (Megatron's
    convention). The weights are initialized as in `initialization`: the same
    seed gives the same global weight at any tensor-parallel size.

    Arguments:
        input_size: in, the input features; divisible by tp_group.size.
        output_size: out, the output features.
        tp_group: the tensor-parallel group (e.g. `state.tp`).
        bias: whether the layer has a bias (initialized to zero).
        input_is_parallel: the input is already split, [s, b, in/tp].
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: reduce-scatter the output along s to [s/tp, b, out];
            needs input_is_parallel.
        init_method: fills the full [out, in] weight in place.
        params_dtype: dtype of the parameters.
        device: device of the parameters (default: torch's default device).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: RankGroup,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.input_size_per_partition = divide(input_size, tp_group, "input_size")
        if isinstance(output_size, bool) or not isinstance(output_size, int) or output_size <= 0:
            raise ValueError(f"output_size={output_size!r} must be a positive integer")
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel=True needs input_is_parallel=True "
                "(the input of a sequence-parallel row-parallel layer is [s, b, in/tp])"
            )
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel

        factory = {"dtype": params_dtype, "device": device}
        self.weight = torch.nn.Parameter(
            torch.empty(
                output_size,
                self.input_size_per_partition,
                dtype=params_dtype,
                device=weight_device(device),
            )
        )
        init_partitioned_weight(self.weight, (output_size, input_size), 1, tp_group, init_method)
        mark_partitioned(self.weight, 1, tp_group)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, **factory))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.fp8_matmul = None
        """mp_layers.fp8.Fp8Matmul when the local GEMM computes in FP8 (mp_layers.fp8)."""

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, in/tp] (or [s, b, in]) -> ([s, b, out] or [s/tp, b, out], bias or None)."""
        if not self.input_is_parallel:
            input = scatter_to_tensor_model_parallel_region(input, self.tp_group)
        if self.fp8_matmul is not None:
            partial = self.fp8_matmul(input, self.weight)
        else:
            partial = F.linear(input, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """weight split along its second axis; bias whole, a replica on TP ranks > 0."""
        rank, size = self.tp_group.rank, self.tp_group.size
        pieces = {
            f"{prefix}weight": ShardedTensor.from_rank(
                f"{prefix}weight", self.weight, 1, rank, size
            )
        }
        if self.bias is not None:
            pieces[f"{prefix}bias"] = ShardedTensor.from_rank(
                f"{prefix}bias", self.bias, None, rank, size, replica_id=rank
            )
        return pieces

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"tp={self.tp_group.size}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
