"""TopKRouter: which experts each token goes to, and with which weight.

Shapes: x [s, b, h] (this rank's tokens: [s/tp, b, h] with sequence parallelism),
flattened to T = s b tokens; logits = x w^T (+ b with add_bias_linear, Megatron's router
bias and gpt-oss's) [T, E], w [E, h], b [E]; the result is Megatron's pair
probs [T, E] (the routing weight of each chosen expert, 0 elsewhere) and
routing_map [T, E] (bool, the chosen experts).

Scores (Megatron's topk_routing_with_score_function): softmax with pre_softmax takes
the top k of softmax(logits); softmax without it the top k logits, then a softmax over
those k (equal to renormalizing the top k of the full softmax, Mixtral's rule); sigmoid
the top k of sigmoid(logits) (+ the expert bias, for the choice only), normalized to sum
1 when k > 1 (pre_softmax has no effect there). A scaling factor multiplies the weights.

Group-limited routing (DeepSeek-V2/V3, Megatron's group_limited_topk): the E experts form
G groups of E/G consecutive ones; each token ranks the groups by the sum of their top
k // group_topk values (those the top k is taken of: logits, softmax or biased sigmoid
scores), keeps the best group_topk and takes its top k among their experts only.

With a capacity factor each expert keeps at most ceil(T k / E * factor) of its tokens
(Megatron's rule; none dropped when that exceeds T): those with the highest weights
("probs") or the earliest ("position"); with pad_to_capacity it computes exactly that
many, padded with tokens of weight 0.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_moe import balancing_losses
from mp_layers.moe import aux_losses
from mp_layers.tensor_parallel import deferred_init
from mp_layers.tensor_parallel.initialization import init_partitioned_weight
from mp_layers.transformer.recompute import recomputing
from mp_state import DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, RankGroup, RNGStatesTracker

__all__ = [
    "TopKRouter",
    "capacity_mask",
    "expert_capacity",
    "routers_of",
    "take_metrics",
    "update_expert_biases",
]

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(torch.nn.Module):
    """`token_group` (tp x cp; None: tp) holds the parts of this rank's sequences, over
    which the load-balancing and z losses count tokens (Megatron's tp_cp group);
    `balance_group` (tp x dp x cp, needed by the global load-balancing loss only; None:
    this rank alone) is where that loss counts tokens."""

    def __init__(
        self, config: TransformerConfig, tp_group: RankGroup,
        balance_group: RankGroup | None = None, token_group: RankGroup | None = None,
        rng_tracker: RNGStatesTracker | None = None,
    ) -> None:  # fmt: skip
        """rng_tracker: draws moe_router_force_load_balancing's logits (its expert-parallel
        stream; None or without it: the default generator)."""
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker
        self.tp_group = tp_group
        self.token_group = tp_group if token_group is None else token_group
        self.balance_group = balance_group
        self.experts, self.topk = config.num_moe_experts, config.moe_router_topk
        # The same draw on every rank (an fp32 master), left on the meta device to be drawn
        # shard by shard under deferred_init.deferred_weights().
        shape = (self.experts, config.hidden_size)
        self.weight = torch.nn.Parameter(torch.empty(
            shape, dtype=config.params_dtype, device=deferred_init.weight_device(None)
        ))  # fmt: skip
        normal = functools.partial(torch.nn.init.normal_, std=config.hidden_init_std)
        init_partitioned_weight(self.weight, shape, None, tp_group, normal)
        self.bias = None
        if config.add_bias_linear:  # Megatron's TopKRouter: normal, as the weight
            bias = torch.empty(self.experts).normal_(std=config.hidden_init_std)
            self.bias = torch.nn.Parameter(bias.to(config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.experts))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(self.experts), persistent=False
            )
        else:
            self.expert_bias = None
        if config.moe_router_load_balancing_type == "quantile_balancing":
            # Quantile balancing's bias (checkpointed) and the step's quantiles so far.
            self.register_buffer("qb_beta", torch.zeros(self.experts))
            self.register_buffer("qb_beta_accum", torch.zeros(self.experts), persistent=False)
            self.register_buffer("qb_beta_count", torch.zeros(()), persistent=False)
        else:
            self.qb_beta = None
        self.balancing_losses = balancing_losses(config)
        """Type -> coefficient of the load-balancing losses computed in training."""
        if "global_aux_loss" in self.balancing_losses:
            # Counts over balance_group, summed over the micro-batches since the last reset
            # (Megatron's global_tokens_per_expert and ga_steps).
            self.register_buffer("global_tokens_per_expert", torch.zeros(self.experts),
                                 persistent=False)  # fmt: skip
            self.register_buffer("global_steps", torch.zeros(()), persistent=False)
        self.aux_loss_scale = aux_losses.AuxLossScale("moe")
        """The factor the auxiliary losses' gradients get in backward (the training step
        shares its own: aux_losses.share_aux_loss_scale)."""
        self.metrics: dict[str, torch.Tensor] = {}
        """Sums over the micro-batches since the last reset of the auxiliary losses divided by
        their coefficients (Megatron's logged values), this rank's part."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, b, h = x.shape
        eps = self.config.moe_input_jitter_eps
        if eps is not None and self.training and torch.is_grad_enabled():
            # from the default generator, the same on the tensor-parallel ranks (which
            # route the same tokens without sequence parallelism)
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        dtype = _DTYPES.get(self.config.moe_router_dtype, x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(x.reshape(s * b, h).to(dtype), self.weight.to(dtype), bias)  # [T, E]
        forced = self.config.moe_router_force_biased
        if self.config.moe_router_force_load_balancing or forced is not None:
            logits = _RandomLogits.apply(logits, self.rng_tracker)
        if forced is not None:
            logits = logits + self._forced_bias(forced, logits)
        training = self.training and torch.is_grad_enabled()
        # A recomputation for backward routes again; what the first run counted stays.
        counting = training and not recomputing()
        coeff = self.config.moe_z_loss_coeff
        if coeff and training:
            loss = aux_losses.z_loss(logits, coeff / self.token_group.size)
            logits = aux_losses.attach(logits, loss, self.aux_loss_scale)
            if counting:
                self._record("z_loss", loss / coeff)
        chosen = None if self.qb_beta is None else self._quantile_choice(logits, counting)
        probs, routing_map = self._topk(logits, chosen)
        if self.config.moe_expert_capacity_factor is not None:
            keep = capacity_mask(
                probs, routing_map, self.topk, self.config.moe_expert_capacity_factor,
                self.config.moe_token_drop_policy,
            )  # fmt: skip
            if not self.config.moe_pad_expert_input_to_capacity:
                keep = keep & routing_map
            probs, routing_map = probs * keep, keep
        if training and self.balancing_losses:
            probs = self._attach_balancing_losses(probs, logits, s, b, counting)
        if counting and self.expert_bias is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs.to(x.dtype), routing_map

    def _forced_bias(self, std: float, logits: torch.Tensor) -> torch.Tensor:
        """moe_router_force_biased's bias: drawn anew each forward (std > 0), or once and
        kept (std < 0)."""
        if std >= 0:
            return _draw_bias(std, logits, self.rng_tracker)
        kept = getattr(self, "_kept_bias", None)
        if kept is None:
            kept = self._kept_bias = _draw_bias(-std, logits, self.rng_tracker)
        return kept

    def _quantile_choice(self, logits: torch.Tensor, counting: bool) -> torch.Tensor:
        """Quantile balancing's experts [T, k]: the top k of logits - qb_beta. Counting, it
        also adds the micro-batch's column quantile to the step's (over the sequences'
        tokens gathered from token_group: each expert's m k / E share of the m tokens)."""
        with torch.no_grad():
            local = logits.detach().float()
            top = (local - self.qb_beta).topk(self.topk + 1, dim=1)
            if not counting:
                return top.indices[:, :-1]
            group = self.token_group
            full = local
            if group.size > 1:
                full = local.new_empty((local.shape[0] * group.size, local.shape[1]))
                dist.all_gather_into_tensor(full, local.contiguous(), group=group.group)
                top = (full - self.qb_beta).topk(self.topk + 1, dim=1)
            tokens = full.shape[0]
            if tokens * self.topk % self.experts:
                raise ValueError(
                    f"quantile balancing: {tokens} tokens x moe_router_topk={self.topk} "
                    f"must divide over num_moe_experts={self.experts} (Megatron-LM's rule)"
                )
            share = tokens * self.topk // self.experts
            quantile = (full - top.values[:, -1:]).topk(share + 1, dim=0).values[-1]
            self.qb_beta_accum += quantile
            self.qb_beta_count += 1
            rows = local.shape[0]
            return top.indices[group.rank * rows : (group.rank + 1) * rows, :-1]

    def _topk(self, logits: torch.Tensor, chosen: torch.Tensor | None = None):
        """(probs, routing_map) [T, E]: the score function's weights of the chosen experts
        (the top k, or `chosen` [T, k] given by quantile balancing)."""
        config = self.config
        if config.moe_router_load_balancing_type == "sinkhorn":
            return self._sinkhorn(logits)
        if config.moe_router_score_function == "softmax":
            if config.moe_router_pre_softmax:
                scores = torch.softmax(logits, -1, dtype=torch.float32)
                weights, chosen = self._choose(scores, chosen)
            else:
                top, chosen = self._choose(logits, chosen)
                weights = torch.softmax(top, -1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            ranking = scores if self.expert_bias is None else scores + self.expert_bias
            chosen = self._choose(ranking, chosen)[1]
            weights = scores.gather(1, chosen)
            if self.topk > 1:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if config.moe_router_topk_scaling_factor:
            weights = weights * config.moe_router_topk_scaling_factor
        probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, chosen, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
        return probs, routing_map

    def _sinkhorn(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S-BASE routing (Megatron-LM's sinkhorn): in training the top k of the logits'
        Sinkhorn-Knopp balancing choose, in evaluation the top k of the weights; the weights
        are the sigmoid of the logits at top-1, their softmax above, not renormalized."""
        if self.topk == 1:
            weights = torch.sigmoid(logits.float())
        else:
            weights = torch.softmax(logits, -1, dtype=torch.float32)
        if self.training:
            with torch.no_grad():
                chosen = sinkhorn(logits.float()).topk(self.topk, dim=1).indices
        else:
            chosen = weights.topk(self.topk, dim=1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
        return weights * routing_map, routing_map

    def _choose(self, ranking: torch.Tensor, chosen: torch.Tensor | None = None):
        """The top k of ranking [T, E] (values, indices [T, k]); with groups, among the
        experts of each token's best moe_router_group_topk groups; given `chosen`, those."""
        if chosen is not None:
            return ranking.gather(1, chosen), chosen
        groups, group_topk = self.config.moe_router_num_groups, self.config.moe_router_group_topk
        if groups is None:
            return ranking.topk(self.topk)
        tokens = ranking.shape[0]
        per_group = ranking.view(tokens, groups, -1)  # [T, G, E/G]
        group_score = per_group.topk(self.topk // group_topk).values.sum(-1)  # [T, G]
        kept = group_score.topk(group_topk).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept, True)
        allowed = allowed.unsqueeze(-1).expand_as(per_group).reshape(tokens, -1)
        return ranking.masked_fill(~allowed, float("-inf")).topk(self.topk)

    def _attach_balancing_losses(self, probs, logits, s: int, b: int, counting: bool):
        """The load-balancing losses (each type with its coefficient, Megatron's order) over
        this micro-batch's tokens, per sequence or over the global batch, from the scores of
        every expert and the top-k choice they make (no bias, no drop)."""
        if self.config.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, -1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(
            1, scores.topk(self.topk)[1], True
        )
        for kind, coeff in self.balancing_losses.items():
            loss = self._balancing_loss(kind, coeff, scores, chosen, s, b)
            if counting:
                self._record(BALANCING_LOSS_NAMES[kind], loss / coeff)
            probs = aux_losses.attach(probs, loss, self.aux_loss_scale)
        return probs

    def _balancing_loss(self, kind: str, coeff: float, scores, chosen, s: int, b: int):
        group = self.token_group
        if kind == "seq_aux_loss":
            # Sequences side by side as b E "experts": the sum of b per-sequence losses.
            scores, chosen = scores.reshape(s, -1), chosen.reshape(s, -1)
            counts = _summed(chosen.sum(0).float(), group)
            total = s * group.size
            loss = aux_losses.load_balancing_loss(
                scores, counts, total, self.topk, self.experts, coeff
            )
            return loss / b  # the mean over the sequences
        if kind == "global_aux_loss":
            counts, total = self._global_counts(chosen)
        else:  # aux_loss
            counts = _summed(chosen.sum(0).float(), group)
            total = scores.shape[0] * group.size
        return aux_losses.load_balancing_loss(scores, counts, total, self.topk, self.experts, coeff)

    def _global_counts(self, chosen: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Megatron's global load balancing: this micro-batch's counts summed over
        balance_group, added to those of the step's earlier micro-batches and averaged over
        them; the tokens of one micro-batch over the group."""
        counts = chosen.sum(0).float()
        group = self.balance_group
        if group is not None and group.size > 1:
            dist.all_reduce(counts, group=group.group)
        with torch.no_grad():
            self.global_tokens_per_expert += counts
            self.global_steps += 1
        size = 1 if group is None else group.size
        return self.global_tokens_per_expert / self.global_steps, chosen.shape[0] * size

    def reset_global_counts(self) -> None:
        """A new step: the global load-balancing loss counts from zero again."""
        if "global_aux_loss" in self.balancing_losses:
            self.global_tokens_per_expert.zero_()
            self.global_steps.zero_()

    def _record(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.metrics[name] = self.metrics[name] + value if name in self.metrics else value

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        tensors = {"weight": self.weight}
        if self.bias is not None:
            tensors["bias"] = self.bias
        if self.expert_bias is not None:
            tensors["expert_bias"] = self.expert_bias
        if self.qb_beta is not None:
            tensors["qb_beta"] = self.qb_beta
        return {
            prefix + name: ShardedTensor.from_rank(
                prefix + name, data, None, 0, 1, replica_id=self.tp_group.rank
            )
            for name, data in tensors.items()
        }


BALANCING_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
"""The name each load-balancing loss is logged under (Megatron's)."""


def _draw_bias(std: float, like: torch.Tensor, tracker: RNGStatesTracker | None):
    """[E] from N(0, std), the same on every rank: the data-parallel stream (seeded alike
    everywhere; the default generator without a tracker)."""
    bias = torch.empty(like.shape[-1], dtype=like.dtype, device=like.device)
    if tracker is not None and DATA_PARALLEL_RNG in tracker.names:
        with tracker.fork(DATA_PARALLEL_RNG):
            return bias.normal_(std=std)
    return bias.normal_(std=std)


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """The Sinkhorn-Knopp balancing of exp(cost) [T, E]: row and column scalings d0, d1
    updated in turn until d1 moves by less than `tol` on average (Megatron-LM's
    tolerance and eps), so that every expert's column sums to about T / E of the rows'
    unit mass; returns d1 exp(cost) d0."""
    cost = torch.exp(cost)
    rows = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    columns = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    eps, error = 1e-8, float("inf")
    while error > tol:
        rows = 1 / (cost.shape[0] * ((columns * cost).sum(1) + eps))
        updated = 1 / (cost.shape[1] * ((rows.unsqueeze(1) * cost).sum(0) + eps))
        error = float((updated - columns).abs().mean())
        columns = updated
    return columns * cost * rows.unsqueeze(1)


def expert_capacity(tokens: int, topk: int, experts: int, factor: float) -> int:
    """Megatron's get_capacity: ceil(tokens * topk / experts * factor)."""
    return math.ceil(tokens * topk / experts * factor)


class _RandomLogits(torch.autograd.Function):
    """Standard normal logits in the shape of `logits` (moe_router_force_load_balancing);
    backward passes the gradient through (a straight-through estimator, as Megatron's)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tracker: RNGStatesTracker | None) -> torch.Tensor:
        if tracker is not None and EXPERT_PARALLEL_RNG in tracker.names:
            with tracker.fork(EXPERT_PARALLEL_RNG):
                return torch.randn_like(logits)
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def capacity_mask(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, policy: str
) -> torch.Tensor:
    """[T, E] bool: the token slots each expert keeps under its capacity."""
    tokens, experts = probs.shape
    capacity = expert_capacity(tokens, topk, experts, factor)
    if capacity > tokens:
        return torch.ones_like(routing_map)
    if policy == "probs":
        kept = probs.topk(capacity, dim=0).indices
    else:
        # The first `capacity` routed tokens of each expert; unrouted ones after them.
        order = (
            torch.where(routing_map, 0, tokens) + torch.arange(tokens, device=probs.device)[:, None]
        )
        kept = order.topk(capacity, dim=0, largest=False).indices
    return torch.zeros_like(routing_map).scatter(0, kept, True)


def _summed(counts: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Token counts (no gradient) summed over group."""
    if group.size > 1:
        dist.all_reduce(counts, group=group.group)
    return counts


def routers_of(modules) -> list[TopKRouter]:
    """Every router in the given modules (model chunks), in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]


def take_metrics(routers: list[TopKRouter]) -> dict[str, torch.Tensor]:
    """Per auxiliary loss, its value summed over the routers' micro-batches since the last
    call (this rank's part); resets them."""
    totals: dict[str, torch.Tensor] = {}
    for router in routers:
        for name, value in router.metrics.items():
            totals[name] = totals[name] + value if name in totals else value
        router.metrics = {}
    return totals


def update_quantile_biases(routers: list[TopKRouter], group: RankGroup) -> None:
    """After a step's micro-batches (Megatron's _update_router_qb_beta): each quantile-
    balancing router's mean quantile over them, averaged over `group` (the data-parallel
    ranks with the context-parallel ones), blended with its bias by
    moe_router_quantile_balancing_ema and centred, becomes the bias; the sums restart."""
    routers = [r for r in routers if r.qb_beta is not None and r.training]
    if not routers:
        return
    means = torch.stack([r.qb_beta_accum / r.qb_beta_count.clamp(min=1) for r in routers])
    if group.size > 1:
        dist.all_reduce(means, op=dist.ReduceOp.AVG, group=group.group)
    with torch.no_grad():
        for router, mean in zip(routers, means, strict=True):
            ema = router.config.moe_router_quantile_balancing_ema
            beta = ema * router.qb_beta + (1.0 - ema) * mean
            router.qb_beta.copy_(beta - beta.mean())
            router.qb_beta_accum.zero_()
            router.qb_beta_count.zero_()


def update_expert_biases(routers: list[TopKRouter], group: RankGroup) -> None:
    """After a step's micro-batches: sum each router's token counts over `group` (every rank
    of this pipeline stage: tp x dp x cp) and move its bias by rate * sign(mean - count)."""
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    if group.size > 1:
        dist.all_reduce(counts, group=group.group)
    with torch.no_grad():
        for router, count in zip(routers, counts, strict=True):
            offset = count.mean() - count
            router.expert_bias += torch.sign(offset) * router.config.moe_router_bias_update_rate
            router.local_tokens_per_expert.zero_()
