"""Parameters that every tensor-parallel rank holds whole (layer norms, QK norms, the
down projections and latent norms of multi-latent attention): their sharding
description, with rank 0's copy the one saved and the others marked as its replicas."""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_state import RankGroup

__all__ = ["replicated_state_dict"]


def replicated_state_dict(
    module: torch.nn.Module, prefix: str, tp_group: RankGroup
) -> dict[str, ShardedTensor]:
    """Every parameter of `module` as a whole tensor named prefix + its name."""
    return {
        prefix + name: ShardedTensor.from_rank(
            prefix + name, p, None, 0, 1, replica_id=tp_group.rank
        )
        for name, p in module.named_parameters()
    }
