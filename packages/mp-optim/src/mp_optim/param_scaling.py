"""scale_rows: multiply rows of a model parameter in place, in the model and in the
optimizer's fp32 main parameters alike (QK-clip's update after a step, mp_layers.qk_clip).

The main parameter is what the next step starts from, so scaling the model's copy alone
would be undone by the next copy back; a main parameter that is the model's own memory
(fp32, aliased) is scaled once. With the distributed optimizer each rank's main
parameter is a flat range of the parameter, and under FSDP its rows of it: each gets its
part of the factors. The optimizer's state (moments, momentum) is left as it is, as
Megatron-LM's clip_qk leaves it.
"""

from __future__ import annotations

import torch

__all__ = ["scale_rows"]


@torch.no_grad()
def scale_rows(optimizer, param: torch.nn.Parameter, scale: torch.Tensor) -> None:
    """Multiplies row i of `param` (its dimension 0, as this rank holds it) by scale[i],
    in the model and in every main parameter of `optimizer` that covers it."""
    if scale.shape != (param.shape[0],):
        raise ValueError(f"scale of shape {tuple(scale.shape)} for a parameter of "
                         f"{param.shape[0]} rows")  # fmt: skip
    factors = scale.to(torch.float32).view(-1, *[1] * (param.dim() - 1)).expand(param.shape)
    flat = factors.reshape(-1)
    shards = optimizer.shards.get(param, ())
    if not optimizer.fully_sharded:  # FSDP's model rows are the main parameters
        factors = factors.to(param.device)
        param.data.copy_(param.data.float().mul_(factors).to(param.dtype))
    for shard in shards:
        if shard.aliased and not optimizer.fully_sharded:
            continue  # the model's own memory: scaled above
        main = shard.main_param
        part = flat[shard.start : shard.start + main.numel()].to(main.device)
        main.view(-1).mul_(part)
