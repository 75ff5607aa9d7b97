"""Mixture of experts (Megatron's MoE layer): router, token dispatchers, grouped experts,
auxiliary losses. docs/moe.md tells how a token travels through them."""

from mp_layers.moe.aux_losses import AuxLossScale, share_aux_loss_scale
from mp_layers.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mp_layers.moe.experts import GroupedExperts, grouped_matmul, is_expert_key
from mp_layers.moe.moe_layer import MoELayer, SharedExperts
from mp_layers.moe.router import (
    BALANCING_LOSS_NAMES,
    TopKRouter,
    capacity_mask,
    expert_capacity,
    routers_of,
    take_metrics,
    update_expert_biases,
    update_quantile_biases,
)

__all__ = [
    "BALANCING_LOSS_NAMES",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "AuxLossScale",
    "GroupedExperts",
    "MoELayer",
    "SharedExperts",
    "TopKRouter",
    "capacity_mask",
    "expert_capacity",
    "grouped_matmul",
    "is_expert_key",
    "routers_of",
    "share_aux_loss_scale",
    "take_metrics",
    "update_expert_biases",
    "update_quantile_biases",
]
