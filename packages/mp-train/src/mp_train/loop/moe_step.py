"""What a training step does for mixture-of-experts layers, beside the schedule (which
knows nothing of them):

- before the micro-batches: the factor the routers' auxiliary losses get in backward,
  the one the main loss gets (the loss scale / the number of micro-batches, times cp;
  with a per-token loss the loss scale alone, as in Megatron), and the one the
  multi-token prediction losses get (the same without the cp), and the one the
  sparse-attention indexers' losses get (the MTP losses'), each an AuxLossScale this
  step holds and shares with the model chunks' routers, MTP modules or indexers;
  the global load-balancing loss's token counts start from zero;
- after them: the expert biases of auxiliary-loss-free balancing move (their token
  counts summed over the stage's tp x dp x cp ranks, Megatron's finalize step);
- for the log: each auxiliary loss (divided by its coefficient, as Megatron logs it)
  per micro-batch, summed over tensor- and context-parallel parts and pipeline stages,
  averaged over data-parallel ranks (summed for the global loss, whose ranks' parts add
  up to the global batch's loss, as in Megatron) and over the model's MoE layers (the
  MTP modules' included):
  `load_balancing_loss` (or `seq_load_balancing_loss`, `global_load_balancing_loss`)
  and `z_loss`, beside `lm loss`; with moe_per_layer_logging also each layer's,
  `moe/<name>_layer_<i>` (Megatron's tags: i the layer's 0-based number in the model, the
  MTP modules' layers numbered after the model's; 0 for a layer without experts), reduced
  as the averages but not divided by the number of MoE layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_layers import (
    MultiTokenPrediction,
    TransformerConfig,
    TransformerLayer,
    balancing_losses,
    moe,
    mtp_layer_kinds,
)
from mp_state import ParallelState

__all__ = ["PER_LAYER_PREFIX", "MoEStep", "aux_loss_names", "router_layers"]

PER_LAYER_PREFIX = "moe/"
"""The tags of the per-layer auxiliary losses (moe_per_layer_logging) begin so."""


def aux_loss_names(model: TransformerConfig) -> list[str]:
    """The auxiliary losses a model's routers record in training, in log order."""
    if model.num_moe_experts is None:
        return []
    names = [moe.BALANCING_LOSS_NAMES[kind] for kind in balancing_losses(model)]
    if model.moe_z_loss_coeff:
        names.append("z_loss")
    return names


class MoEStep:
    def __init__(self, model_config: TransformerConfig, chunks, state: ParallelState,
                 fp16: bool, per_token: bool = False, per_layer: bool = False,
                 microbatch_tokens: int | None = None) -> None:  # fmt: skip
        """per_token: the step sums the losses and divides the gradients by the batch's
        tokens (calculate_per_token_loss); microbatch_tokens, needed then: the positions
        of one micro-batch (micro-batch size x sequence length), by which the routers'
        losses are scaled back."""
        if per_token and not microbatch_tokens:
            raise ValueError(
                "MoEStep(per_token=True) needs microbatch_tokens (micro-batch size x "
                "sequence length), by which the routers' losses are scaled back"
            )
        self.routers = moe.routers_of(chunks)
        # With per_layer: each router's layer number, and how many layers are logged.
        self.router_layers = router_layers(chunks, model_config) if per_layer else None
        self.logged_layers = model_config.num_layers + (model_config.mtp_num_layers or 0)
        self.per_token, self.microbatch_tokens = per_token, microbatch_tokens
        self.names = aux_loss_names(model_config)
        # The MTP modules' MoE layers count too (Megatron's): the last one's shape, or a
        # hybrid model's pattern's.
        module = sum(moe for _, moe in mtp_layer_kinds(model_config))
        self.moe_layers = (sum(model_config.moe_layer_pattern())
                           + (model_config.mtp_num_layers or 0) * module)  # fmt: skip
        self.state, self.fp16 = state, fp16
        # The factors the routers' and the MTP modules' losses get in backward, set each step.
        self.scale, self.mtp_scale = moe.AuxLossScale("moe"), moe.AuxLossScale("mtp")
        self.dsa_scale = moe.AuxLossScale("dsa")  # the sparse-attention indexers' loss
        for scale in (self.scale, self.mtp_scale, self.dsa_scale):
            moe.share_aux_loss_scale(chunks, scale)

    def before(self, optimizer, num_microbatches: int) -> None:
        scale = optimizer.get_loss_scale() if self.fp16 else 1.0
        # Each context-parallel rank's balancing loss is its tokens' part of the sequences'
        # loss, and the gradients are averaged over cp: times cp, as in Megatron. With a
        # per-token loss the gradients are summed over dp x cp and finalize divides them by
        # the batch's tokens (micro-batches x dp x a micro-batch's positions when every
        # position counts): the routers' losses are scaled by a micro-batch's positions,
        # which leaves them the mean path's 1 / (micro-batches x dp), as in Megatron.
        cp = self.state.cp.size
        if self.per_token:
            self.scale.set(scale * self.microbatch_tokens)
        else:
            self.scale.set(scale * cp / num_microbatches)
        # Multi-token prediction's losses: a mean per rank, the main loss's factor.
        self.mtp_scale.set(scale if self.per_token else scale / num_microbatches)
        # The indexers' loss: each rank's mean over its own queries (a sum per token), so
        # that the gradients' average over dp x cp is the whole sequences': the MTP
        # losses' factor. (Megatron multiplies by cp too, which would weigh the loss cp
        # times under context parallelism; mp's layouts follow the one-rank curve.)
        self.dsa_scale.set(scale if self.per_token else scale / num_microbatches)
        for router in self.routers:
            router.reset_global_counts()

    def discard(self) -> None:
        """Drops what the routers summed so far, for the log and for the expert biases'
        update (an iteration's run to be redone: only the run that counts is kept)."""
        moe.take_metrics(self.routers)
        for router in self.routers:
            if router.expert_bias is not None:
                router.local_tokens_per_expert.zero_()
            if router.qb_beta is not None:
                router.qb_beta_accum.zero_()
                router.qb_beta_count.zero_()

    def after_backward(self) -> None:
        moe.update_expert_biases(self.routers, self.state.tp_dp_cp)
        moe.update_quantile_biases(self.routers, self.state.dp_cp)

    def aux_losses(self, num_microbatches: int) -> dict[str, float]:
        """The logged auxiliary losses of the step (collective over every rank)."""
        if not self.names:
            return {}
        per_layer = None
        if self.router_layers is not None:  # before take_metrics resets the routers' sums
            per_layer = torch.zeros(len(self.names), self.logged_layers)
            for router, layer in zip(self.routers, self.router_layers, strict=True):
                for i, name in enumerate(self.names):
                    if name in router.metrics:
                        per_layer[i, layer] += router.metrics[name].cpu()
        taken = moe.take_metrics(self.routers)
        values = torch.stack([taken.get(n, torch.zeros(())).float() for n in self.names])
        if per_layer is not None:  # reduced together with the totals: one collective
            values = torch.cat([values[:, None], per_layer], dim=1)
        if dist.get_backend() == "nccl":
            values = values.cuda()
        for group in (self.state.tp_cp, self.state.pp):
            if group.size > 1:
                dist.all_reduce(values, group=group.group)
        dp = self.state.dp
        if dp.size > 1:
            dist.all_reduce(values, group=dp.group)
        summed = torch.tensor([n == "global_load_balancing_loss" for n in self.names])
        values = values.cpu() / torch.where(summed, 1, dp.size).view(-1, *[1] * (values.dim() - 1))
        if per_layer is not None:
            values, per_layer = values[:, 0], values[:, 1:] / num_microbatches
        values = values / (num_microbatches * self.moe_layers)
        logged = {name: float(v) for name, v in zip(self.names, values, strict=True)}
        if per_layer is not None:
            for name, row in zip(self.names, per_layer, strict=True):
                for layer, value in enumerate(row.tolist()):
                    logged[f"{PER_LAYER_PREFIX}{name}_layer_{layer}"] = value
        return logged


def router_layers(chunks, model_config: TransformerConfig) -> list[int]:
    """The 0-based layer number of each router of moe.routers_of(chunks), in its order:
    the decoder layer's own, num_layers + k for the k-th multi-token prediction module."""
    number: dict[int, int] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                for router in moe.routers_of([module]):
                    number[id(router)] = module.layer_number
        for module in chunk.modules():  # after: an MTP module's layer is built as the last one
            if isinstance(module, MultiTokenPrediction):
                for k, layer in enumerate(module.layers):
                    for router in moe.routers_of([layer]):
                        number[id(router)] = model_config.num_layers + k
    return [number[id(router)] for router in moe.routers_of(chunks)]
