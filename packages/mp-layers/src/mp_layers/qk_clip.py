"""QK-clip's parts (mp_layers.config_qk_clip has the rules): the attention layers that keep
their largest logits, those logits reduced over ranks, and the row scales of the query and
key weights that bring a layer's largest logit down to the threshold.

    layers = logit_layers(model_chunks)
    maxima = reduce_max_logits(layers, state.dp_cp)     # collective; resets the layers'
    for layer, m in zip(layers, maxima):
        for param, rows in qk_clip_scales(layer, m, config):
            mp_optim.scale_rows(optimizer, param, rows)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers.config import TransformerConfig
from mp_layers.transformer.attention import SelfAttention
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_state import RankGroup

__all__ = ["logit_layers", "qk_clip_scales", "reduce_max_logits"]


def logit_layers(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The softmax attention layers (SelfAttention, MultiLatentAttention) of the chunks
    whose core attention keeps its largest logits, in module order."""
    return [module for chunk in model_chunks for module in chunk.modules()
            if isinstance(module, SelfAttention | MultiLatentAttention)
            and module.core_attention.track_max_logits]  # fmt: skip


def reduce_max_logits(layers: list[torch.nn.Module], group: RankGroup) -> list[torch.Tensor]:
    """Each layer's largest logit per head of this rank ([heads] fp32), the maximum over
    `group` (the data- and context-parallel ranks, which hold the same heads), and resets
    the layers'. A layer that saw no training forward counts -inf. Collective over
    `group`: every rank calls it with the same layers."""
    if not layers:
        return []
    found = []
    for layer in layers:
        core = layer.core_attention
        heads = _heads(layer)
        device = next(layer.parameters()).device
        found.append(core.max_logits if core.max_logits is not None
                     else torch.full((heads,), -torch.inf, device=device))  # fmt: skip
        core.max_logits = None
    sizes = [t.numel() for t in found]
    flat = torch.cat([t.float().to(device) for t in found])
    if group.size > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group.group)
    return list(flat.split(sizes))


RowScales = list[tuple[torch.nn.Parameter, torch.Tensor]]
"""(weight, the factor of each of its rows on this rank)."""


def qk_clip_scales(layer: torch.nn.Module, max_logits: torch.Tensor,
                   config: TransformerConfig) -> RowScales:  # fmt: skip
    """(weight, row scales) for the layer's query and key projections, nothing when no
    group's (head's) largest logit exceeds the threshold (config_qk_clip's rules)."""
    t, alpha = config.qk_clip_threshold, config.qk_clip_alpha
    if isinstance(layer, MultiLatentAttention):
        eta = _eta(max_logits, t)
        if eta is None:
            return []
        q = torch.stack([eta**alpha, eta], dim=1)  # per head: [nope, rotary] factors
        q_rows = q.repeat_interleave(torch.tensor([layer.dn, layer.dr]), dim=1).reshape(-1)
        kv = torch.stack([eta ** (1 - alpha), torch.ones_like(eta)], dim=1)
        kv_rows = kv.repeat_interleave(torch.tensor([layer.dn, layer.dv]), dim=1).reshape(-1)
        query = layer.linear_q_proj or layer.linear_q_up_proj
        return [(query.weight, q_rows), (layer.linear_kv_up_proj.weight, kv_rows)]
    groups = max_logits.view(layer.groups, -1).amax(dim=1)  # a group's heads share its key
    if layer.shared:  # and the ranks that share the group
        groups = _over_shared_group(groups, layer)
    eta = _eta(groups, t)
    if eta is None:
        return []
    parts = layer.linear_qkv.weight.qkv_rows  # per group: q, [gate,] k, v rows
    factors = [eta**alpha, *([torch.ones_like(eta)] if layer.gated else []),
               eta ** (1 - alpha), torch.ones_like(eta)]  # fmt: skip
    rows = torch.stack(factors, dim=1).repeat_interleave(torch.tensor(parts), dim=1)
    return [(layer.linear_qkv.weight, rows.reshape(-1))]


def _over_shared_group(maximum: torch.Tensor, layer: SelfAttention) -> torch.Tensor:
    """The largest of this rank's group's logits over the ranks sharing the group ([1]).
    Collective over the layer's TP group."""
    group, share = layer.tp_group, layer.shared.share
    every = torch.empty(group.size, dtype=maximum.dtype, device=maximum.device)
    dist.all_gather_into_tensor(every, maximum.contiguous(), group=group.group)
    first = group.rank // share * share
    return every[first : first + share].amax().view(1)


def _eta(maxima: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """min(threshold / maximum, 1) of each, or None when none exceeds the threshold."""
    maxima = maxima.float().cpu()
    if not bool((maxima > threshold).any()):
        return None
    return torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))


def _heads(layer: torch.nn.Module) -> int:
    """This rank's query heads of a layer."""
    if isinstance(layer, MultiLatentAttention):
        return layer.heads
    return layer.groups * layer.per_group
