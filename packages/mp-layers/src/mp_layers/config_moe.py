"""TransformerConfig's mixture-of-experts fields (MoeConfig, one of its bases; Megatron's
--num-experts and --moe-* options) and their validation: the rules that hold whatever the
layout (`check_moe`, from __post_init__) and those that depend on the parallel sizes
(`check_expert_parallel`, from check_parallel). Every message names the field and the
value."""

from __future__ import annotations

import warnings
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Literal

from mp_layers.config_rules import choice, left_default, positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "BALANCING_LOSSES",
    "MoeConfig",
    "balancing_losses",
    "check_expert_parallel",
    "check_moe",
]


BalancingType = Literal[
    "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"
]
"""A router's load balancing: a loss type, Sinkhorn routing, quantile balancing, or none."""


@dataclass(kw_only=True)
class MoeConfig:
    """Mixture of experts (Megatron's --num-experts and --moe-* options): a base of
    TransformerConfig, checked by `check_moe` and `check_expert_parallel`."""

    num_moe_experts: int | None = field(
        default=None, metadata={"argparse_meta": {"names": ["--num-experts"]}}
    )
    """Routed experts of each MoE layer (Megatron's --num-experts); None: a dense model
    (the command line's 0 too, as in Megatron-LM)."""

    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert; None: ffn_hidden_size."""

    moe_router_topk: int = 2
    """Experts each token is sent to."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """How the router turns its logits into scores."""

    moe_router_pre_softmax: bool = False
    """With softmax scores: the softmax over all experts, then the top k (their weights do
    not sum to 1); False: the top k logits, then a softmax over those k. No effect with
    sigmoid scores (as in Megatron, which accepts it there)."""

    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2/V3's device- or node-limited routing): the
    experts are split into this many equal groups (consecutive expert indices); None: no
    groups. Needs moe_router_group_topk."""

    moe_router_group_topk: int | None = None
    """Group-limited routing: the groups each token may use, those with the highest sum of
    their top (topk / group_topk) scores (with the expert bias, if any); the top k experts
    are then chosen within them. Needs moe_router_num_groups."""

    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the routing weights of the chosen experts."""

    moe_router_load_balancing_type: BalancingType | list[BalancingType] = field(
        default="aux_loss", metadata={"argparse_meta": {"nargs": "+"}}
    )
    """The auxiliary load-balancing loss: over the micro-batch's tokens (Switch
    Transformer), per sequence (DeepSeek-V2/V3), over the global batch (token counts
    summed over the tp x dp x cp ranks and averaged over the step's micro-batches so far),
    or none; or "sinkhorn" (S-BASE, Megatron-LM's): in training the experts are chosen by
    the Sinkhorn-Knopp balancing of the micro-batch's logits (no loss, so
    moe_aux_loss_coeff 0), weighted by the sigmoid (top-1) or softmax of the logits, not
    renormalized, whatever moe_router_score_function says; in evaluation by those weights.
    Or "quantile_balancing" (Megatron-LM's dual coordinate-descent quantile balancing): the
    experts are the top k of the logits minus a per-expert bias, which each step sets to
    the mean over the data-parallel ranks of its micro-batches' column quantiles (each
    expert's share m k / E of the m tokens; moe_router_quantile_balancing_ema blends in
    the previous bias), centred; no loss; the weights are the score function's.
    Or a list of the loss types (Megatron's), each computed with its own coefficient of
    the moe_aux_loss_coeff list and logged apart (load_balancing_loss,
    seq_load_balancing_loss, global_load_balancing_loss); a list of one is that type."""

    moe_aux_loss_coeff: float | list[float] = field(
        default=0.0, metadata={"argparse_meta": {"nargs": "+"}}
    )
    """Weight of the load-balancing loss (0: not computed); with a list of types, a list of
    as many weights, one each."""

    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); None: none."""

    moe_router_enable_expert_bias: bool = False
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores
    when choosing experts (not to the weights), moved after each step towards the
    experts that received fewer tokens than the mean."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert bias update: bias += rate * sign(mean load - load)."""

    moe_router_quantile_balancing_ema: float = 0.0
    """Quantile balancing's bias: ema x the previous one + (1 - ema) x the step's quantile
    estimate (0: replaced each step, Megatron's default)."""

    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(tokens * topk / experts * factor) tokens of a
    micro-batch (per rank); the others are dropped (their weight is 0). None: no limit."""

    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: every expert computes exactly its capacity, padded."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an expert over capacity keeps: the highest routing weights, or the
    earliest positions."""

    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token passes through; None: none."""

    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w) with a learned w [1, h]
    (Qwen2-MoE's shared_expert_gate)."""

    moe_layer_freq: list[int] = field(default_factory=lambda: [1])
    """Which layers are MoE: one value N, every N-th (layer i when i % N == 0); or one 0/1
    per layer (num_layers values), also as Megatron's "([0]+[1]*26)". An int N is [N]."""

    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = "allgather"
    """How tokens reach experts on other expert-parallel ranks: an all-to-all of each
    expert's tokens, or an all-gather of every token. Megatron's "flex" (DeepEP or
    HybridEP kernels) is refused."""

    moe_grouped_gemm: bool = False
    """Compute the local experts with torch's grouped matmul (torch._grouped_mm) instead of
    one matmul per expert."""

    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Precision of the router's logits and scores; None: the activations' dtype."""

    moe_router_force_load_balancing: bool = False
    """For benchmarks only (Megatron's --moe-router-force-load-balancing): the router's
    logits are replaced by standard normal draws (the expert-parallel RNG stream, a
    different one per expert shard), so tokens spread evenly over the experts whatever the
    weights; the gradient passes through to the logits unchanged."""

    moe_router_force_biased: float | None = None
    """For benchmarks only (Megatron's --moe-router-force-biased S): as
    moe_router_force_load_balancing, then a per-expert bias drawn from N(0, |S|) added to the
    random logits, the same on every rank (the data-parallel RNG stream), so some experts
    get more tokens: an imbalance to measure. S > 0 draws a new bias at each forward; S < 0
    draws one per layer and keeps it."""

    moe_input_jitter_eps: float | None = None
    """Multiply the router's input by uniform noise in [1 - eps, 1 + eps] in training
    (Switch Transformer's jitter; Megatron's --moe-input-jitter-eps), only the router's:
    the experts see the tokens unchanged."""

    moe_apply_probs_on_input: bool = False
    """Multiply each expert's input, not its output, by the token's routing weight (Llama 4;
    Megatron's --moe-apply-probs-on-input): y = expert(p x) instead of p expert(x). Needs
    moe_router_topk 1, as in Megatron."""

    moe_latent_size: int | None = None
    """Latent MoE (Nemotron 3 Super and Ultra; Megatron's --moe-latent-size): the routed
    experts run in a space of this width. The router sees the hidden state; fc1_latent_proj
    projects it down before the dispatch and fc2_latent_proj projects the combined output
    back up (both whole on every tensor-parallel rank); a shared expert runs on the hidden
    state. None: the experts run at hidden_size."""


_MOE_DEFAULTS = {
    "moe_shared_expert_intermediate_size": None,
    "moe_expert_capacity_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_apply_probs_on_input": False,
    "moe_latent_size": None,
    "moe_input_jitter_eps": None,
}
"""Fields that mean something only in a MoE model: set without num_moe_experts, refused."""


def _unused_moe_fields(config: TransformerConfig) -> list[str]:
    """The other MoE fields (name=value) a dense model was given away from their defaults."""
    given = []
    for item in fields(MoeConfig):
        if item.name in _MOE_DEFAULTS or not item.name.startswith("moe_"):
            continue
        default = item.default_factory() if item.default is MISSING else item.default
        value = getattr(config, item.name)
        if value != default:
            given.append(f"{item.name}={value!r}")
    return given


def check_moe(config: TransformerConfig) -> None:
    """Fills moe_ffn_hidden_size and checks the MoE fields; a dense model must leave them."""
    _balancing_lists(config)
    if config.num_moe_experts is None:
        left_default(config, {**_MOE_DEFAULTS, "moe_ffn_hidden_size": None}, "num_moe_experts")
        unused = _unused_moe_fields(config)
        if unused:
            warnings.warn(
                f"{', '.join(unused)} without num_moe_experts: a dense model has no MoE layer "
                "to apply them to, so they change nothing (Megatron-LM accepts them there too)",
                stacklevel=4,  # the caller of TransformerConfig(...)
            )
        return
    positive("num_moe_experts", config.num_moe_experts)
    eps = config.moe_input_jitter_eps
    if eps is not None and not 0.0 < eps < 1.0:
        raise ValueError(f"moe_input_jitter_eps={eps} must be in (0, 1)")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    positive("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    positive("moe_router_topk", config.moe_router_topk)
    if config.moe_router_topk > config.num_moe_experts:
        raise ValueError(
            f"moe_router_topk={config.moe_router_topk} exceeds "
            f"num_moe_experts={config.num_moe_experts}"
        )
    _check_router(config)
    if (config.moe_router_topk == 1 and config.moe_router_score_function == "softmax"
            and not config.moe_router_pre_softmax
            and config.moe_router_load_balancing_type != "sinkhorn"):  # fmt: skip
        raise ValueError(
            "moe_router_topk=1 with softmax scores needs moe_router_pre_softmax=True "
            "(--moe-router-pre-softmax): a softmax over the one chosen logit is 1, and the "
            "router would get no gradient (Megatron-LM's rule)"
        )
    if config.moe_apply_probs_on_input and config.moe_router_topk != 1:
        raise ValueError(
            f"moe_apply_probs_on_input=True needs moe_router_topk=1 (got "
            f"{config.moe_router_topk}): the weights of several experts cannot all scale one "
            "input (Megatron's rule)"
        )
    if config.moe_latent_size is not None:
        positive("moe_latent_size", config.moe_latent_size)
    choice("moe_token_drop_policy", config.moe_token_drop_policy, ("probs", "position"))
    if config.moe_token_dispatcher_type == "flex":
        raise ValueError("moe_token_dispatcher_type='flex' needs DeepEP or HybridEP (CUDA "
                         "kernels mp does not have): use 'alltoall', which moves the same "
                         "tokens")  # fmt: skip
    choice("moe_token_dispatcher_type", config.moe_token_dispatcher_type, ("alltoall", "allgather"))
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ValueError(f"moe_expert_capacity_factor={factor} must be > 0")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor")
    if config.moe_shared_expert_intermediate_size is not None:
        positive("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size)
        if config.add_bias_linear:
            raise ValueError(
                "add_bias_linear=True with moe_shared_expert_intermediate_size="
                f"{config.moe_shared_expert_intermediate_size}: the shared expert has no biases "
                "(as in Megatron); set add_bias_linear=False or drop the shared expert"
            )
    elif config.moe_shared_expert_gate:
        raise ValueError("moe_shared_expert_gate=True needs moe_shared_expert_intermediate_size")
    config.moe_layer_pattern()  # validates moe_layer_freq


BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
"""The load-balancing loss types, in the order a router computes them (Megatron's)."""


def _balancing_lists(config: TransformerConfig) -> None:
    """Megatron's list form (`--moe-router-load-balancing-type a b` with one coefficient
    each): a list of one is that one value (as Megatron-LM's arguments make it); several
    need as many coefficients (Megatron's rule), each a loss type named once."""
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(kinds, (list, tuple)) and len(kinds) == 1:
        kinds = config.moe_router_load_balancing_type = kinds[0]
    if isinstance(coeffs, (list, tuple)) and len(coeffs) == 1:
        coeffs = config.moe_aux_loss_coeff = float(coeffs[0])
    several = isinstance(kinds, (list, tuple))
    if several != isinstance(coeffs, (list, tuple)) or (several and len(kinds) != len(coeffs)):
        raise ValueError(
            f"moe_aux_loss_coeff={coeffs!r} with moe_router_load_balancing_type={kinds!r}: "
            "one coefficient per load-balancing type (Megatron's rule)"
        )
    if not several:
        return
    config.moe_router_load_balancing_type = list(kinds)
    config.moe_aux_loss_coeff = [float(c) for c in coeffs]
    for kind in kinds:
        if kind in ("sinkhorn", "quantile_balancing"):
            raise ValueError(f"moe_router_load_balancing_type={list(kinds)!r}: {kind} is a "
                             "way to route, not a loss: it stands alone")  # fmt: skip
        choice("moe_router_load_balancing_type", kind, (*BALANCING_LOSSES, "none"))
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"moe_router_load_balancing_type={list(kinds)!r} names a type twice")


def balancing_losses(config: TransformerConfig) -> dict[str, float]:
    """The load-balancing losses a router computes in training: type -> coefficient, those
    with a coefficient > 0, in BALANCING_LOSSES order."""
    kinds, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if not isinstance(kinds, list):
        kinds, coeffs = [kinds], [coeffs]
    given = dict(zip(kinds, coeffs, strict=True))
    return {kind: given[kind] for kind in BALANCING_LOSSES if given.get(kind, 0) > 0}


def _check_sinkhorn(config: TransformerConfig) -> None:
    """Sinkhorn routing chooses and weighs the experts its own way: the fields that would
    change that (which Megatron-LM's sinkhorn path leaves unread) are refused."""
    if config.moe_aux_loss_coeff:
        raise ValueError(
            f"moe_router_load_balancing_type='sinkhorn' with moe_aux_loss_coeff="
            f"{config.moe_aux_loss_coeff}: Sinkhorn routing balances without a loss (as in "
            "Megatron-LM, which asserts it); set moe_aux_loss_coeff=0"
        )
    if config.moe_expert_capacity_factor is not None:
        raise ValueError(
            "moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, "
            "global_aux_loss or none load balancing (Megatron-LM's rule), not sinkhorn"
        )
    ignored = {
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_router_num_groups": config.moe_router_num_groups,
        "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
    }
    _refuse_given(ignored, "sinkhorn", "Sinkhorn routing chooses and weighs the experts "
                  "without it (Megatron-LM's reads none of them)")  # fmt: skip


def _check_quantile_balancing(config: TransformerConfig) -> None:
    """Quantile balancing picks the experts by its own bias: Megatron-LM's rules (no
    group-limited routing, no capacity), and the fields it would leave unread refused."""
    ema = config.moe_router_quantile_balancing_ema
    if not 0 <= ema < 1:
        raise ValueError(f"moe_router_quantile_balancing_ema={ema} must be in [0, 1)")
    if config.moe_router_load_balancing_type != "quantile_balancing":
        if ema:
            raise ValueError(f"moe_router_quantile_balancing_ema={ema} needs "
                             "moe_router_load_balancing_type='quantile_balancing'")  # fmt: skip
        return
    refused = {
        "moe_router_num_groups": config.moe_router_num_groups,  # Megatron-LM asserts
        "moe_expert_capacity_factor": config.moe_expert_capacity_factor,  # and refuses
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_aux_loss_coeff": config.moe_aux_loss_coeff,
    }
    _refuse_given(refused, "quantile_balancing", "quantile balancing chooses the experts by "
                  "its own bias and balances without a loss (Megatron-LM refuses groups and "
                  "capacity, and reads none of the others)")  # fmt: skip


def _refuse_given(fields: dict, kind: str, why: str) -> None:
    """The first of `fields` (name -> value) given (truthy) is refused beside routing `kind`."""
    for name, value in fields.items():
        if value:
            raise ValueError(
                f"{name}={value!r} with moe_router_load_balancing_type={kind!r}: {why}; drop it"
            )


def _check_router(config: TransformerConfig) -> None:
    # Megatron accepts moe_router_pre_softmax with sigmoid scores, where it has no effect.
    choice("moe_router_score_function", config.moe_router_score_function, ("softmax", "sigmoid"))
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError(
            "moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid' "
            f"(got {config.moe_router_score_function!r}), as in Megatron"
        )
    if not isinstance(config.moe_router_load_balancing_type, list):
        choice(
            "moe_router_load_balancing_type", config.moe_router_load_balancing_type,
            (*BALANCING_LOSSES, "sinkhorn", "quantile_balancing", "none"),
        )  # fmt: skip
    if config.moe_router_load_balancing_type == "sinkhorn":
        _check_sinkhorn(config)
    _check_quantile_balancing(config)
    if "global_aux_loss" in balancing_losses(config) and (
        config.recompute_granularity == "full"
        or config.moe_layer_recompute
        or config.recomputes("moe")
    ):
        raise ValueError(
            "moe_router_load_balancing_type='global_aux_loss' with a recomputed router "
            f"(recompute_granularity={config.recompute_granularity!r}, moe_layer_recompute="
            f"{config.moe_layer_recompute}): the recomputation would see other running token "
            "counts than the first forward; use aux_loss or seq_aux_loss, or selective recompute"
        )
    _check_groups(config)
    if config.moe_router_dtype is not None:
        choice("moe_router_dtype", config.moe_router_dtype, ("fp32", "fp64"))
    coeffs = config.moe_aux_loss_coeff
    lowest = min(coeffs) if isinstance(coeffs, list) else coeffs
    rate = config.moe_router_bias_update_rate
    for name, value in (("moe_aux_loss_coeff", lowest), ("moe_router_bias_update_rate", rate)):
        if value < 0:
            raise ValueError(f"{name}={getattr(config, name)} must be >= 0")
    if config.moe_z_loss_coeff is not None and config.moe_z_loss_coeff < 0:
        raise ValueError(f"moe_z_loss_coeff={config.moe_z_loss_coeff} must be >= 0")


def _check_groups(config: TransformerConfig) -> None:
    """Group-limited routing: both fields or neither, groups that split the experts evenly
    and hold the top k."""
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError(
            f"moe_router_num_groups={groups} with moe_router_group_topk={group_topk}: "
            "group-limited routing needs both (or neither)"
        )
    if groups is None:
        return
    positive("moe_router_num_groups", groups)
    positive("moe_router_group_topk", group_topk)
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts % groups:
        raise ValueError(
            f"moe_router_num_groups={groups} does not divide num_moe_experts={experts}"
        )
    if group_topk > groups:
        raise ValueError(
            f"moe_router_group_topk={group_topk} exceeds moe_router_num_groups={groups}"
        )
    if topk > group_topk * (experts // groups):
        raise ValueError(
            f"moe_router_topk={topk} exceeds the {group_topk * (experts // groups)} experts "
            f"of moe_router_group_topk={group_topk} groups of {experts // groups}"
        )
    if topk < group_topk:
        # A group's score sums its top (topk // group_topk) scores: zero of them here.
        raise ValueError(
            f"moe_router_topk={topk} is below moe_router_group_topk={group_topk}: each group "
            "would be ranked by the sum of its top 0 scores"
        )


def check_expert_parallel(config: TransformerConfig, tp: int, cp: int, ep: int, etp: int) -> None:
    """The rules of the expert-parallel (ep) and expert tensor-parallel (etp) sizes."""
    if config.num_moe_experts is None:
        if ep > 1:
            raise ValueError(f"expert_model_parallel_size={ep} needs num_moe_experts (a MoE model)")
        return
    if config.num_moe_experts % ep:
        raise ValueError(
            f"expert_model_parallel_size={ep} does not divide "
            f"num_moe_experts={config.num_moe_experts}"
        )
    if config.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"expert_tensor_parallel_size={etp} does not divide "
            f"moe_ffn_hidden_size={config.moe_ffn_hidden_size}"
        )
