"""QK-clip after the optimizer step (Megatron's clip_qk; mp_layers.config_qk_clip has the
rules): the attention layers' largest logits reduced over the data- and context-parallel
ranks and reset, with qk_clip the query and key rows scaled in the model and in the
optimizer's main parameters, and the model's largest logit for the log."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.qk_clip import logit_layers, qk_clip_scales, reduce_max_logits
from mp_optim import scale_rows

__all__ = ["clip_after_step"]


def clip_after_step(run, stepped: bool) -> float | None:
    """The model's largest attention logit this iteration (the same on every rank), after
    clipping when qk_clip and the step was taken (`stepped`: a skipped step leaves the
    weights alone, where its logits may be nan); None without qk_clip or its log.
    Collective: every rank calls it after each iteration's step."""
    config = run.config.model
    if not config.tracks_max_attention_logit:
        return None
    layers = logit_layers([chunk.module for chunk in run.model])
    maxima = reduce_max_logits(layers, run.state.dp_cp)
    if config.qk_clip and stepped:
        for layer, found in zip(layers, maxima, strict=True):
            for param, rows in qk_clip_scales(layer, found, config):
                scale_rows(run.optimizer, param, rows)
    largest = torch.tensor([max((float(m.max()) for m in maxima), default=-torch.inf)],
                           device=run.device)  # fmt: skip
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest.item())
