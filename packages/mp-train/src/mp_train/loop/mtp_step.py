"""The multi-token prediction losses of a training step, for the log (Megatron's
MTPLossLoggingHelper): `mtp_1 loss` .. `mtp_D loss`, each module's loss per micro-batch
(its masked mean on a rank), summed over the step's micro-batches and divided by their
number, averaged over data- and context-parallel ranks, from the last pipeline stage
(where the modules are) to every rank. Written to TensorBoard every iteration, beside
the MoE auxiliary losses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers import MultiTokenPrediction, TransformerConfig
from mp_state import ParallelState

__all__ = ["discard_mtp_losses", "mtp_loss_names", "mtp_losses"]


def mtp_loss_names(model: TransformerConfig) -> list[str]:
    return [f"mtp_{k + 1} loss" for k in range(model.mtp_num_layers or 0)]


def mtp_losses(
    chunks, model: TransformerConfig, state: ParallelState, num_microbatches: int
) -> dict[str, float]:
    """The step's logged MTP losses (collective over every rank)."""
    names = mtp_loss_names(model)
    if not names:
        return {}
    values = torch.zeros(len(names))
    for module in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(module, MultiTokenPrediction):
            values += module.take_losses().cpu()
    if dist.get_backend() == "nccl":
        values = values.cuda()
    for group in (state.pp, state.dp_cp):
        if group.size > 1:
            dist.all_reduce(values, group=group.group)
    values = values.cpu() / (state.dp_cp.size * num_microbatches)
    return {name: float(v) for name, v in zip(names, values, strict=True)}


def discard_mtp_losses(chunks) -> None:
    """Drops the MTP losses the modules summed so far (an iteration's run to be redone)."""
    for module in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(module, MultiTokenPrediction):
            module.take_losses()
