"""The sparse-attention indexers' loss of a training step, for the log (Megatron's
DSAIndexerLossLoggingHelper): `indexer loss`, each layer's indexer loss (times
dsa_indexer_loss_coeff) summed over the step's micro-batches and divided by their
number, summed over the layers of every pipeline stage and divided by their number (the
multi-token prediction modules' layers included: num_layers + mtp_num_layers), averaged
over data- and context-parallel ranks (each context-parallel rank's is the mean over its
own queries; the tensor-parallel ranks compute the same loss).
Logged with dsa_indexer_loss_coeff > 0, beside the MoE and multi-token prediction
losses. The factor the loss gets in backward is the step's (moe_step.MoEStep)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers import LightningIndexer, TransformerConfig
from mp_state import ParallelState

__all__ = ["discard_indexer_losses", "indexer_loss_names", "indexer_losses"]


def indexer_loss_names(model: TransformerConfig) -> list[str]:
    return ["indexer loss"] if (model.dsa_indexer_loss_coeff or 0) > 0 else []


def _indexers(chunks):
    return (m for chunk in chunks for m in chunk.modules() if isinstance(m, LightningIndexer))


def indexer_losses(
    chunks, model: TransformerConfig, state: ParallelState, num_microbatches: int
) -> dict[str, float]:
    """The step's logged indexer loss (collective over every rank)."""
    if not indexer_loss_names(model):
        return {}
    value = torch.zeros(())
    for indexer in _indexers(chunks):
        value += indexer.take_loss().cpu()
    if dist.get_backend() == "nccl":
        value = value.cuda()
    for group in (state.pp, state.dp_cp):
        if group.size > 1:
            dist.all_reduce(value, group=group.group)
    layers = model.num_layers + (model.mtp_num_layers or 0)
    value = value.cpu() / (state.dp_cp.size * num_microbatches * layers)
    return {"indexer loss": float(value)}


def discard_indexer_losses(chunks) -> None:
    """Drops the losses the indexers summed so far (an iteration's run to be redone)."""
    for indexer in _indexers(chunks):
        indexer.take_loss()
