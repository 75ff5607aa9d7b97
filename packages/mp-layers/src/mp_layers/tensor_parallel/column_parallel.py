"""ColumnParallelLinear: Y = X A^T + b with A split by rows (output features).

Shapes: [s, b, h] = sequence, batch, hidden; x/tp is this rank's piece of x.

    weight  [out/tp, in]      rank r holds output features r*out/tp .. (r+1)*out/tp
    bias    [out/tp]
    input   [s, b, in]        replicated on the TP ranks
            [s/tp, b, in]     with sequence_parallel (this rank's piece of the sequence)
    output  [s, b, out/tp]    or [s, b, out] with gather_output

Each rank computes its own output features from the whole input; nothing is
communicated in the forward unless the input is sequence-parallel (all-gather
along s) or the output is gathered. In the backward the input gradient is a
partial sum over each rank's features: it is all-reduced, or reduce-scattered
along s under sequence parallelism.

Without sequence parallelism the layer is `F.linear` behind the
copy-to-TP-region mapping (identity forward, all-reduce backward), so
autograd and autocast treat it as any linear layer. Under sequence
parallelism a custom autograd function saves only its local input [s/tp, b, in]
for the backward and all-gathers it again there to compute the weight
gradient, as Megatron does: keeping the gathered [s, b, in] would undo the
activation-memory saving that sequence parallelism is for. (Megatron also
overlaps these collectives with the matmuls on GPUs; this implementation
runs them in order.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.tensor_parallel.collectives import gather_first, reduce_scatter_first
from mp_layers.tensor_parallel.deferred_init import weight_device
from mp_layers.tensor_parallel.initialization import InitMethod, init_partitioned_weight
from mp_layers.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from mp_layers.tensor_parallel.partition import divide, mark_partitioned
from mp_state import RankGroup

__all__ = ["ColumnParallelLinear"]


class _SequenceParallelMatmul(torch.autograd.Function):
    """[s/tp, b, in] -> [s, b, out/tp]: all-gather along s in forward (and again in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        total = gather_first(x, group)
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # Under autocast the forward matmul ran in a lower precision than the saved
        # fp32 weight; backward may run outside autocast, so compute in grad_out's
        # dtype (autograd casts the weight gradient back to the parameter's dtype).
        weight = weight.to(grad_out.dtype)
        x = x.to(grad_out.dtype)
        group = ctx.group
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # Each rank's part of dL/dX comes from its own output features: sum them.
            grad_total = torch.matmul(grad_out, weight)
            grad_x = reduce_scatter_first(grad_total, group)
        if ctx.needs_input_grad[1]:
            total = gather_first(x, group)
            grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
            grad_weight = grad_out_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0)
        return grad_x, grad_weight, grad_bias, None


class ColumnParallelLinear(torch.nn.Module):
    """A linear layer whose output features are split over `tp_group`.

    forward(input) returns (output, bias): bias is None unless skip_bias_add,
    in which case the bias is not added and this rank's piece [out/tp] is
    returned for the caller to fuse into a later operation (Megatron's
    convention). The weights are initialized as in `initialization`: the same
    seed gives the same global weight at any tensor-parallel size.

    Arguments:
        input_size: in, the input features.
        output_size: out, the output features; divisible by tp_group.size.
        tp_group: the tensor-parallel group (e.g. `state.tp`).
        bias: whether the layer has a bias (initialized to zero).
        gather_output: all-gather the output to [s, b, out] on every rank.
        skip_bias_add: return the bias instead of adding it.
        sequence_parallel: the input is [s/tp, b, in], gathered along s here.
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
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size <= 0:
            raise ValueError(f"input_size={input_size!r} must be a positive integer")
        self.output_size_per_partition = divide(output_size, tp_group, "output_size")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel

        factory = {"dtype": params_dtype, "device": device}
        self.weight = torch.nn.Parameter(
            torch.empty(
                self.output_size_per_partition,
                input_size,
                dtype=params_dtype,
                device=weight_device(device),
            )
        )
        init_partitioned_weight(self.weight, (output_size, input_size), 0, tp_group, init_method)
        mark_partitioned(self.weight, 0, tp_group)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, **factory))
        else:
            self.register_parameter("bias", None)
        self.fp8_matmul = None
        """mp_layers.fp8.Fp8Matmul when the local GEMM computes in FP8 (mp_layers.fp8)."""

    def forward(
        self, input: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[s, b, in] (or [s/tp, b, in]) -> ([s, b, out/tp] or [s, b, out], bias or None).
        weight: used instead of self.weight (Megatron's; a detached copy, say)."""
        bias = None if self.skip_bias_add else self.bias
        weight = self.weight if weight is None else weight
        if self.fp8_matmul is not None:
            output = self.fp8_matmul(self.matmul_input(input), weight)
            if bias is not None:
                output = output + bias
        elif self.sequence_parallel:
            output = _SequenceParallelMatmul.apply(input, weight, bias, self.tp_group)
        else:
            output = F.linear(self.matmul_input(input), weight, bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def matmul_input(self, input: torch.Tensor) -> torch.Tensor:
        """The input [s, b, in] as this layer's matmul sees it, for a matmul other than
        forward()'s own (the FP8 one, chunked_linear_cross_entropy): behind the mapping
        whose backward sums the ranks' partial input gradients, an all-reduce, or under
        sequence parallelism the all-gather of [s/tp, b, in] whose backward
        reduce-scatters (a caller that saves it for backward keeps [s, b, in], where the
        sequence-parallel matmul of forward() keeps [s/tp, b, in])."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input, self.tp_group)
        return copy_to_tensor_model_parallel_region(input, self.tp_group)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """weight and bias, each split along its first axis over the TP ranks."""
        rank, size = self.tp_group.rank, self.tp_group.size
        pieces = {
            f"{prefix}weight": ShardedTensor.from_rank(
                f"{prefix}weight", self.weight, 0, rank, size
            )
        }
        if self.bias is not None:
            pieces[f"{prefix}bias"] = ShardedTensor.from_rank(
                f"{prefix}bias", self.bias, 0, rank, size
            )
        return pieces

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"tp={self.tp_group.size}, bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )
