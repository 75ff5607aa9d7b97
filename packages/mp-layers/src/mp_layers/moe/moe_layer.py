"""MoELayer: the MLP of a mixture-of-experts layer (Megatron's MoELayer).

Shapes: x [s, b, h] (this rank's tokens; [s/tp, b, h] with sequence parallelism, where
each tensor-parallel rank routes its own tokens); T = s b.

    probs, routing_map = router(x)                 [T, E] each      (tp: aux-loss counts)
    tokens, counts, weights = dispatcher.dispatch(...)  [N, h], [El], [N]  (ep, expert_tp / tp_ep)
    out = experts(tokens, counts, weights)         [N, h]           (local experts)
    y = dispatcher.combine(out)                    [T, h]           (expert_tp, ep / tp_ep)
    y += shared_experts(x) [* sigmoid(x w)]        every token      (tp, like a dense MLP)

A latent MoE layer (moe_latent_size L) routes on x but dispatches fc1_latent_proj(x)
[T, L], its experts run at width L, and fc2_latent_proj brings the combined [T, L] back
to [T, h] before the shared expert's output is added (moe/latent.py).

Without sequence parallelism at tp > 1 (generation, which runs without it) every
tensor-parallel rank holds all T tokens: each routes its own ceil(T / tp) of them, as it
would its sequence-parallel part, and the routed outputs are all-gathered over tp before
the shared expert's (a dense tensor-parallel MLP on all T) is added. A training step
there is refused: the router's replicated weights would need their gradients summed over
tp (Megatron-LM refuses MoE with tensor parallelism but no sequence parallelism in
training too).

Returns (y [s, b, h], None): no bias to add with the residual.
"""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.groups import ModelGroups
from mp_layers.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mp_layers.moe.experts import GroupedExperts
from mp_layers.moe.latent import LatentProjection
from mp_layers.moe.router import TopKRouter
from mp_layers.tensor_parallel.mappings import gather_from_sequence_parallel_region
from mp_layers.transformer.eager import eager_when_compiled
from mp_layers.transformer.mlp import MLP
from mp_layers.transformer.recompute import checkpointed
from mp_state import RNGStatesTracker

__all__ = ["MoELayer", "SharedExperts"]


class MoELayer(torch.nn.Module):
    def __init__(self, config: TransformerConfig, groups: ModelGroups,
                 rng_tracker: RNGStatesTracker | None = None) -> None:  # fmt: skip
        """rng_tracker: the router's (moe_router_force_load_balancing draws from it)."""
        super().__init__()
        self.router = TopKRouter(config, groups.tp, groups.tp_dp_cp, groups.tp_cp, rng_tracker)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        latent = config.moe_latent_size
        if latent is not None:
            h = config.hidden_size
            self.fc1_latent_proj = LatentProjection(config, groups.tp, h, latent,
                                                    config.hidden_init_std)  # fmt: skip
        self.experts = GroupedExperts(config, groups.ep, groups.expert_tp, width=latent)
        if latent is not None:
            self.fc2_latent_proj = LatentProjection(config, groups.tp, latent, h,
                                                    config.output_layer_init_std)  # fmt: skip
        if config.moe_token_dispatcher_type == "alltoall":
            self.dispatcher = AllToAllDispatcher(
                config.num_moe_experts, groups.ep, groups.expert_tp
            )
        else:
            self.dispatcher = AllGatherDispatcher(config.num_moe_experts, groups.ep, groups.tp_ep)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExperts(config, groups)
        self.recompute_shared = config.recomputes("shared_experts")  # (no random draws)
        self.tp_group = groups.tp
        self.splits_tokens = groups.tp.size > 1 and not config.sequence_parallel
        """Every tensor-parallel rank holds all tokens: each routes its share (docstring)."""

    # Eager inside a compiled layer: the tokens each expert receives depend on the
    # routing (data-dependent shapes, a recompile or graph break every iteration).
    @eager_when_compiled
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, b, h = x.shape
        out = self._routed_share(x.reshape(s * b, h)) if self.splits_tokens else self._routed(x)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            if self.recompute_shared and self.training and torch.is_grad_enabled():
                out = out + checkpointed(self.shared_experts, None, x)
            else:
                out = out + self.shared_experts(x)
        return out, None

    def _routed(self, x: torch.Tensor, pad: int = 0, *, empty: bool = False) -> torch.Tensor:
        """The routed experts' output [T + pad, h] for this rank's tokens x [s, b, h] (T = s
        b), with `pad` rows of zeros after them that go to no expert; empty: x holds no
        token (a row the router's shapes need), which goes to no expert either."""
        s, b, h = x.shape
        probs, routing_map = self.router(x)
        if empty:
            probs, routing_map = torch.zeros_like(probs), torch.zeros_like(routing_map)
        routed = x.reshape(s * b, h)
        if pad:
            routed = torch.cat([routed, routed.new_zeros(pad, h)])
            probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
            routing_map = torch.cat([routing_map, routing_map.new_zeros(pad, probs.shape[1])])
        if self.fc1_latent_proj is not None:
            routed = self.fc1_latent_proj(routed)
        tokens, counts, weights, state = self.dispatcher.dispatch(routed, probs, routing_map)
        out = self.experts(tokens, counts, weights)
        out = self.dispatcher.combine(out, state)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out

    def _routed_share(self, rows: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, h] for all T tokens `rows` [T, h], which every
        tensor-parallel rank holds: this rank routes rows [r c, (r + 1) c), c = ceil(T /
        tp) (the last ranks fewer, or none, padded to c with rows routed nowhere), and the
        outputs are all-gathered over tp."""
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"a MoE layer at tensor_model_parallel_size={self.tp_group.size} trains only "
                "with sequence_parallel=True (each tensor-parallel rank routes its own "
                "tokens); without it, it runs in eval mode or without gradients (generation)"
            )
        total = rows.shape[0]
        share = -(-total // self.tp_group.size)
        start = min(self.tp_group.rank * share, total)
        mine = rows[start : start + share]
        if mine.shape[0]:
            out = self._routed(mine.unsqueeze(1), pad=share - mine.shape[0])
        else:  # no token here (one sequence's decode step at tp 2): a zero row, routed nowhere
            out = self._routed(rows.new_zeros(1, 1, rows.shape[1]), pad=share - 1, empty=True)
        return gather_from_sequence_parallel_region(out, self.tp_group)[:total]

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = self.router.sharded_state_dict(f"{prefix}router.")
        pieces |= self.experts.sharded_state_dict(f"{prefix}experts.")
        for name in ("fc1_latent_proj", "fc2_latent_proj"):
            if getattr(self, name) is not None:
                pieces |= getattr(self, name).sharded_state_dict(f"{prefix}{name}.")
        if self.shared_experts is not None:
            pieces |= self.shared_experts.sharded_state_dict(f"{prefix}shared_experts.")
        return pieces


class SharedExperts(MLP):
    """The expert every token passes through: a dense MLP of inner width
    moe_shared_expert_intermediate_size, split over tp; with moe_shared_expert_gate its
    output is scaled per token by sigmoid(x . gate_weight)."""

    def __init__(self, config: TransformerConfig, groups: ModelGroups) -> None:
        super().__init__(config, groups.tp, config.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            weight = torch.empty(1, config.hidden_size).normal_(std=config.hidden_init_std)
            self.gate_weight = torch.nn.Parameter(weight.to(config.params_dtype))
            self.gate_weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(x)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = super().sharded_state_dict(prefix)
        if self.gate_weight is not None:
            key = prefix + "gate_weight"
            pieces[key] = ShardedTensor.from_rank(
                key, self.gate_weight, None, 0, 1, replica_id=self.tp_group.rank
            )
        return pieces
