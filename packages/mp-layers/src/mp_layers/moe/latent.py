"""The projections of a latent MoE layer (Nemotron 3 Super and Ultra; Megatron's
--moe-latent-size): fc1_latent_proj [latent, h] projects each token down before the
dispatch, fc2_latent_proj [h, latent] projects the combined expert output back up.

Whole on every tensor-parallel rank (Megatron's parallel_mode="duplicated"): each rank
projects its own tokens (MoE layers under tensor parallelism run with sequence
parallelism), so the weights' gradients are partial sums, reduced over tp as the other
sequence-parallel replicated weights are (the `sequence_parallel` attribute). Drawn the
same on every rank as the router's weight: fc1 normal(hidden_init_std), fc2 the scaled
output-layer std; a bias (add_bias_linear) starts at 0.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.tensor_parallel import deferred_init, init_partitioned_weight
from mp_state import RankGroup

__all__ = ["LatentProjection"]


class LatentProjection(torch.nn.Module):
    def __init__(
        self, config: TransformerConfig, tp_group: RankGroup, in_size: int, out_size: int,
        std: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tp_group = tp_group
        shape = (out_size, in_size)
        self.weight = torch.nn.Parameter(torch.empty(
            shape, dtype=config.params_dtype, device=deferred_init.weight_device(None)
        ))  # fmt: skip
        normal = functools.partial(torch.nn.init.normal_, std=std)
        init_partitioned_weight(self.weight, shape, None, tp_group, normal)
        self.bias = None
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.zeros(out_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        tensors = {"weight": self.weight} | ({} if self.bias is None else {"bias": self.bias})
        return {
            prefix + name: ShardedTensor.from_rank(
                prefix + name, data, None, 0, 1, replica_id=self.tp_group.rank
            )
            for name, data in tensors.items()
        }
