"""The query and key norm over all heads together (qk_layernorm_scope "all_heads"; OLMo 2's
q_norm and k_norm, MiniMax-M2's).

Shapes: x [s, b, n, d], this rank's n heads of d channels; the model has `total` channels
(num_attention_heads x d for the queries, num_query_groups x d for the keys), split over
the tensor-parallel ranks with the heads (rank r holds the r-th contiguous piece). Each
position is normalized over all of them:

    y = x / sqrt(sum over every rank's channels of x^2 / total + eps) * weight

in fp32, returned in x's dtype (Hugging Face's Olmo2RMSNorm multiplies by the weight
before the cast too). Each rank adds up its own squares, and one all-reduce over the
tensor-parallel group (sum_over_tensor_model_parallel_region, whose backward all-reduces
too) gives every rank the total. The weight, one per channel, is split with the heads:
each rank's gradient is complete for its own piece, so nothing is summed over TP. With
apply_layernorm_1p it is stored centred on 0 and scales by 1 + weight.

The checkpoint names the whole weight [total], rank r's piece at offset r x n x d.
"""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_layers.tensor_parallel import sum_over_tensor_model_parallel_region
from mp_state import RankGroup

__all__ = ["AllHeadsRMSNorm"]


class AllHeadsRMSNorm(torch.nn.Module):
    def __init__(
        self, local: int, total: int, eps: float, tp_group: RankGroup, *,
        one_p: bool = False, params_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        """local: this rank's channels (its heads x d); total: the model's."""
        super().__init__()
        if local * tp_group.size != total:
            raise ValueError(
                f"{local} channels on each of {tp_group.size} tensor-parallel ranks do not "
                f"make the norm's {total}"
            )
        self.total, self.eps, self.one_p, self.tp_group = total, eps, one_p, tp_group
        self.weight = torch.nn.Parameter(torch.empty(local, dtype=params_dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.one_p else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x32 = x.reshape(*shape[:-2], -1).float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        mean = sum_over_tensor_model_parallel_region(squares, self.tp_group) / self.total
        scale = self.weight.float() + 1 if self.one_p else self.weight.float()
        y = scale * (x32 * torch.rsqrt(mean + self.eps))
        return y.to(x.dtype).view(shape)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        key = f"{prefix}weight"
        group = self.tp_group
        return {key: ShardedTensor.from_rank(key, self.weight, 0, group.rank, group.size)}

    def extra_repr(self) -> str:
        return f"{self.weight.numel()} of {self.total} channels, eps={self.eps}"
