"""Multi-token prediction (DeepSeek-V3's MTP modules; Megatron's MultiTokenPredictionBlock).

After the last layer, module k (1..D) predicts the token k+1 positions ahead. Its input is
the previous module's output h_{k-1} (the decoder's normalized output for k = 1) and the
embedding of the tokens k positions ahead, both normalized and joined:

    x   = eh_proj(cat(enorm(embed(tokens rolled k left)), hnorm(h_{k-1})))   [s, b, h]
    h_k = final_layernorm(transformer_layer(x))

and its loss is the shared output layer's cross entropy of h_k against the labels rolled
k left, under the loss mask rolled alike (the positions past the end count nothing). In
training, mtp_loss_scaling_factor / D of each module's mean loss is added to the model's
gradients through the decoder's output (moe.aux_losses.attach, with the main loss's
backward factor: MultiTokenPrediction.aux_loss_scale, which the training step sets); the
main loss the model returns stays the language model's.

Shapes as in GPTModel: hidden states [s, b, h] ([s/tp, b, h] with sequence
parallelism); tokens, labels and mask [b, s], this rank's two load-balanced chunks with
context parallelism, whose rolls take each chunk's next token from the rank holding the
next chunk (`roll_left`). eh_proj is column-parallel (Megatron's layout: weight
[h/tp, 2h]); its output is gathered over the tensor-parallel ranks (and split over the
sequence again with sequence parallelism). The transformer layer is shaped as the model's
last layer (a MoE layer when that one is). A hybrid model's module has the layers of its
pattern's part after "/" instead (Megatron's unified pattern, "M*M*/*E"): x runs through
each in turn (mtp_model_layer.layers.{j}, Megatron's names), then final_layernorm.

With mtp_detach_heads (Megatron's --mtp-detach-heads) the decoder's output, each
module's embedding of the rolled tokens and the output layer's weight enter the modules
detached: the MTP losses train the modules alone, whose parameters carry
`grad_norm_group = "mtp"` so that the optimizer clips them by their own norm.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_mtp import mtp_layer_kinds
from mp_layers.context_parallel.layout import local_positions, shard_sequence
from mp_layers.groups import ModelGroups
from mp_layers.moe.aux_losses import AuxLossScale
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    replicated_state_dict,
    scatter_to_sequence_parallel_region,
)
from mp_layers.transformer.layer import TransformerLayer
from mp_layers.transformer.layer_hooks import building_layer, layer_built
from mp_layers.transformer.mamba_layer import MambaLayer
from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
from mp_layers.transformer.recompute import checkpointed
from mp_layers.transformer.rope import Rotary
from mp_layers.transformer.seeded_init import seeded_init
from mp_layers.transformer.spec import LayerSpec
from mp_state import RankGroup, RNGStatesTracker

__all__ = ["GRAD_NORM_GROUP", "MultiTokenPrediction", "MultiTokenPredictionLayer", "roll_left"]

GRAD_NORM_GROUP = "mtp"
"""The grad_norm_group of the modules' parameters with mtp_detach_heads (Megatron's)."""


def roll_left(t: torch.Tensor, cp: RankGroup, order: torch.Tensor | None = None) -> torch.Tensor:
    """t [b, s] moved one position left along the sequence, the last position zero.

    With context parallelism t holds this rank's chunks r and 2cp-1-r of the sequence (its
    two halves); each chunk's new last element is the first of the chunk after it: chunk
    r+1 is rank r+1's first half (this rank's second half for the last rank), chunk 2cp-r
    rank r-1's second half (nothing for rank 0: the sequence ends there). order: packed
    samples split by document, their chunk order [b, cp x s] (PackedSeqParams.order):
    the whole samples are gathered, rolled in position order and cut again."""
    if order is not None and cp.size > 1:
        return _roll_left_in_order(t, cp, order.to(t.device))
    rolled = torch.roll(t, -1, dims=-1)
    if cp.size == 1:
        rolled[..., -1] = 0
        return rolled
    half = t.shape[-1] // 2
    firsts = torch.stack([t[..., 0], t[..., half]])  # [2, b]
    gathered = [torch.empty_like(firsts) for _ in range(cp.size)]
    dist.all_gather(gathered, firsts.contiguous(), group=cp.group)
    r = cp.rank
    rolled[..., half - 1] = gathered[r + 1][0] if r + 1 < cp.size else firsts[1]
    rolled[..., -1] = gathered[r - 1][1] if r > 0 else 0
    return rolled


def _roll_left_in_order(t: torch.Tensor, cp: RankGroup, order: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(t) for _ in range(cp.size)]
    dist.all_gather(gathered, t.contiguous(), group=cp.group)
    arrived = torch.cat([local_positions(order.shape[1], cp.size, r) for r in range(cp.size)])
    in_order = torch.empty_like(order, dtype=t.dtype)
    in_order[:, arrived.to(t.device)] = torch.cat(gathered, dim=1)  # the chunk order
    positions = torch.empty_like(in_order).scatter_(1, order, in_order)
    rolled = torch.roll(positions, -1, dims=-1)
    rolled[..., -1] = 0
    return shard_sequence(rolled.gather(1, order), cp.size, cp.rank, dim=1)


class MultiTokenPredictionLayer(torch.nn.Module):
    """One MTP module: enorm, hnorm, eh_proj, a transformer layer (a hybrid model's layers of
    its pattern's multi-token prediction part: mtp_model_layer.layers) and final_layernorm."""

    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None,
        spec: LayerSpec,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_group = groups.tp
        self.rng_tracker = rng_tracker
        h = config.hidden_size
        self.enorm = spec.norm(config, None)
        self.hnorm = spec.norm(config, None)
        with building_layer():  # sharded with the chunk, which holds no copy elsewhere
            self.eh_proj = ColumnParallelLinear(
                2 * h, h, tp_group=groups.tp, bias=False, gather_output=False,
                sequence_parallel=config.sequence_parallel,
                init_method=functools.partial(torch.nn.init.normal_, std=config.hidden_init_std),
                params_dtype=config.params_dtype,
            )  # fmt: skip
        last = config.num_layers - 1  # the layers are shaped as the model's last
        self.transformer_layer = self.mtp_model_layer = None
        if config.hybrid_layer_pattern is None:
            with building_layer():
                layer = TransformerLayer(config, groups, rng_tracker, spec, last)
                # DeepSeek sparse attention: the layer chooses its own positions, though
                # the last decoder layer may reuse another's (config_dsa)
                attention = layer.self_attention
                if isinstance(attention, MultiLatentAttention):
                    attention.choose_own()
            self.transformer_layer = layer_built(layer)
        else:
            layers = []
            for kind, _ in mtp_layer_kinds(config):
                cls = MambaLayer if kind == "mamba" else TransformerLayer
                extra = {} if kind == "mamba" else {"kind": kind}
                with building_layer():
                    layer = cls(config, groups, rng_tracker, spec, last, **extra)
                layers.append(layer_built(layer))
            self.mtp_model_layer = torch.nn.Module()
            self.mtp_model_layer.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = spec.norm(config, None)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        rotary: Rotary | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        recompute = self.config.recompute_granularity == "full"
        if recompute and self.training and torch.is_grad_enabled():
            return checkpointed(self._forward, self.rng_tracker, hidden, embedded, rotary,
                                attention_mask)  # fmt: skip
        return self._forward(hidden, embedded, rotary, attention_mask)

    def _forward(self, hidden, embedded, rotary, attention_mask) -> torch.Tensor:
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(joined)  # [s, b, h/tp], the whole sequence
        x = gather_from_tensor_model_parallel_region(x, self.tp_group)
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        for layer in self.layers():
            x = layer(x, rotary, attention_mask)
        return self.final_layernorm(x)

    def layers(self) -> list[torch.nn.Module]:
        """The module's layers in order: its transformer layer, or a hybrid model's."""
        if self.transformer_layer is not None:
            return [self.transformer_layer]
        return list(self.mtp_model_layer.layers)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = self.eh_proj.sharded_state_dict(f"{prefix}eh_proj.")
        if self.transformer_layer is not None:
            pieces |= self.transformer_layer.sharded_state_dict(f"{prefix}transformer_layer.")
        else:
            for j, layer in enumerate(self.mtp_model_layer.layers):
                pieces |= layer.sharded_state_dict(f"{prefix}mtp_model_layer.layers.{j}.")
        for name in ("enorm", "hnorm", "final_layernorm"):
            pieces |= replicated_state_dict(getattr(self, name), f"{prefix}{name}.", self.tp_group)
        return pieces


class MultiTokenPrediction(torch.nn.Module):
    """The mtp_num_layers modules (one, applied at every depth, with
    mtp_use_repeated_layer), and each depth's training loss since the last `take_losses`
    (per micro-batch: this rank's masked mean, summed over micro-batches)."""

    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None,
        spec: LayerSpec,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        self.depths = config.mtp_num_layers
        """The modules' predictions, each a token further (one module applied that many
        times with mtp_use_repeated_layer)."""
        layers = []
        for k in range(1 if config.mtp_use_repeated_layer else self.depths):
            with seeded_init(init_seed, f"mtp{k}"):
                layers.append(MultiTokenPredictionLayer(config, groups, rng_tracker, spec))
        self.layers = torch.nn.ModuleList(layers)
        if config.mtp_detach_heads:  # clipped apart by mp-optim (Megatron's tag)
            for param in self.parameters():
                param.grad_norm_group = GRAD_NORM_GROUP
        self.losses = torch.zeros(self.depths)
        self.aux_loss_scale = AuxLossScale("mtp")
        """The factor the modules' losses get in backward (the training step shares its
        own: mp_layers.moe.share_aux_loss_scale)."""

    def module(self, k: int) -> MultiTokenPredictionLayer:
        """The module that makes depth k's prediction."""
        return self.layers[k if len(self.layers) > 1 else 0]

    def record(self, k: int, loss: torch.Tensor) -> None:
        if self.losses.device != loss.device:
            self.losses = self.losses.to(loss.device)
        self.losses[k] += loss.detach().float()

    def take_losses(self) -> torch.Tensor:
        taken, self.losses = self.losses, torch.zeros_like(self.losses)
        return taken

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces: dict[str, ShardedTensor] = {}
        for k, layer in enumerate(self.layers):
            pieces |= layer.sharded_state_dict(f"{prefix}layers.{k}.")
        return pieces
