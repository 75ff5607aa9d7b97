"""get_optimizer: parameter groups and the optimizer for DDP- or FSDP-wrapped model chunks.

    groups = {"dp_group": state.dp_cp, "expert_dp_group": state.expert_dp}
    model = [DistributedDataParallel(config, chunk, **groups) for chunk in chunks]
    optimizer = get_optimizer(config, model, mp_group=state.mp, expert_mp_group=state.tp_ep_pp)
    scheduler = get_optimizer_param_scheduler(config, optimizer, global_batch_size=..., ...)

Parameter groups follow Megatron: biases and other 1-D parameters (norm
weights) get no weight decay (wd_mult 0), but for the query and key norms with
config.apply_wd_to_qk_layernorm, unless no_weight_decay_cond says otherwise;
parameters selected by scale_lr_cond get lr_mult. With
config.decoupled_lr, the input embedding's and the output layer's weights (those
the model marks `is_embedding_or_output_parameter`, Megatron's attribute) get
groups of their own, `decoupled_lr: True`, whose schedule runs to max_lr =
decoupled_lr and min_lr = decoupled_min_lr (or min_lr).

With a muP width multiplier m != 1 (mp_layers' use_mup: hidden_size /
mup_base_hidden_size), Megatron's muP rules: the hidden matrices (parameters of two
or more dimensions that are not embedding-class: the model marks its embeddings and
output layer `is_embedding_parameter`, Megatron's attribute) get groups of their own,
`mup: True`: under adam their max_lr, min_lr and eps are divided by m, under muon the
matrices Adam steps get the lr divided by m (Muon's keep theirs); under sgd the
vector-like parameters (embedding-class, biases, norms) get max_lr and min_lr times m.
A decoupled group keeps its decoupled_lr. Parameters with the same (wd_mult, lr_mult,
decoupled, mup) share a group; the groups are in that order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_optim.config import OptimizerConfig
from mp_optim.ddp import DistributedDataParallel
from mp_optim.fsdp import FullyShardedDataParallel
from mp_optim.muon_groups import takes_muon
from mp_optim.optimizer import MixedPrecisionOptimizer
from mp_state import RankGroup

__all__ = [
    "default_no_weight_decay",
    "get_optimizer",
    "get_param_groups",
    "is_embedding_or_output",
    "is_vector_like",
]

ParamCondition = Callable[[str, torch.nn.Parameter], bool]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def _decaying_qk_norms(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule with apply_wd_to_qk_layernorm: the query and key norms decayed."""
    qk_norm = "q_layernorm." in name or "k_layernorm." in name
    return default_no_weight_decay(name, param) and not qk_norm


def get_param_groups(
    model_chunks: list[torch.nn.Module],
    config: OptimizerConfig,
    *,
    no_weight_decay_cond: ParamCondition | None = None,
    scale_lr_cond: ParamCondition | None = None,
    lr_mult: float = 1.0,
    mup_width_mult: float = 1.0,
) -> list[dict]:
    """Groups of model parameters with wd_mult, lr_mult and their initial lr / weight_decay
    (and the decoupled schedule's ends, and muP's, see above)."""
    no_wd = no_weight_decay_cond or default_no_weight_decay
    if config.apply_wd_to_qk_layernorm and no_weight_decay_cond is None:
        no_wd = _decaying_qk_norms
    decoupling = config.decoupled_lr is not None
    groups: dict[tuple[float, float, bool, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            wd_mult = 0.0 if no_wd(name, param) else 1.0
            scale = lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0
            decoupled = decoupling and is_embedding_or_output(param)
            mup = mup_width_mult != 1.0 and not decoupled and _mup_scaled(config, param)
            groups.setdefault((wd_mult, scale, decoupled, mup), []).append(param)
    out = []
    for (wd_mult, scale, decoupled, mup), params in sorted(groups.items()):
        group = {"params": params, "wd_mult": wd_mult, "lr_mult": scale, "lr": config.lr * scale,
                 "weight_decay": config.weight_decay * wd_mult}  # fmt: skip
        if decoupled:
            low = config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr
            group |= {"decoupled_lr": True, "max_lr": config.decoupled_lr, "min_lr": low,
                      "lr": config.decoupled_lr * scale}  # fmt: skip
        if mup:
            group |= _mup_hyper(config, mup_width_mult, scale)
        out.append(group)
    return out


def is_vector_like(param: torch.nn.Parameter) -> bool:
    """muP's vector-like parameters: embedding-class (the model marks its embeddings and
    output layer `is_embedding_parameter`; a copy of the embedding on another stage is
    `shared_embedding`) or of at most one dimension."""
    marked = getattr(param, "is_embedding_parameter", False)
    return bool(marked or getattr(param, "shared_embedding", False)) or param.dim() <= 1


def _mup_scaled(config: OptimizerConfig, param: torch.nn.Parameter) -> bool:
    """muP changes this parameter's schedule: a hidden matrix under adam or lion (whose
    updates are normalized per element as Adam's), one Adam steps under muon, a vector-like
    parameter under sgd."""
    if config.optimizer == "sgd":
        return is_vector_like(param)
    if is_vector_like(param):
        return False
    return config.optimizer in ("adam", "lion") or not takes_muon(param)


def _mup_hyper(config: OptimizerConfig, width: float, lr_mult: float) -> dict:
    """A muP group's schedule ends (and Adam eps): see the module docstring."""
    factor = width if config.optimizer == "sgd" else 1.0 / width
    hyper = {"mup": True, "max_lr": config.lr * factor, "min_lr": config.min_lr * factor,
             "lr": config.lr * factor * lr_mult}  # fmt: skip
    if config.optimizer == "adam":
        hyper["eps"] = config.adam_eps / width
    return hyper


def is_embedding_or_output(param: torch.nn.Parameter) -> bool:
    """The parameter is the input embedding's or the output layer's weight (a model marks
    it `is_embedding_or_output_parameter`, as Megatron's language models do)."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


def get_optimizer(
    config: OptimizerConfig,
    model_chunks: list[DistributedDataParallel] | list[FullyShardedDataParallel],
    *,
    mp_group: RankGroup,
    expert_mp_group: RankGroup | None = None,
    no_weight_decay_cond: ParamCondition | None = None,
    scale_lr_cond: ParamCondition | None = None,
    lr_mult: float = 1.0,
    tp_group: RankGroup | None = None,
    expert_tp_group: RankGroup | None = None,
    mup_width_mult: float = 1.0,
) -> MixedPrecisionOptimizer:
    """The optimizer for this rank's model chunks (see optimizer.py for what it does).

    Arguments:
        config: the OptimizerConfig (lr must be set).
        model_chunks: DistributedDataParallel-wrapped chunks (FullyShardedDataParallel with
            config.fully_sharded), all over the same dp group.
        mp_group: the model-parallel group (`state.mp`), for the gradient norm and
            the inf/nan verdict.
        expert_mp_group: the ranks expert parameters are split over (`state.tp_ep_pp`),
            for their part of the gradient norm; needed with expert parameters.
        no_weight_decay_cond: (name, param) -> True for parameters without weight
            decay; default: biases and 1-D parameters.
        scale_lr_cond, lr_mult: (name, param) -> True for parameters whose lr is
            multiplied by lr_mult.
        tp_group, expert_tp_group: `state.tp` and `state.expert_tp`, for Muon, which
            orthogonalizes a matrix split over them whole.
        mup_width_mult: muP's width multiplier (the model config's mup_width_mult):
            the learning rates and Adam eps of muP (module docstring); 1: none.
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is not set")
    wrapper = FullyShardedDataParallel if config.fully_sharded else DistributedDataParallel
    for i, chunk in enumerate(model_chunks):
        if not isinstance(chunk, wrapper):
            raise TypeError(
                f"model_chunks[{i}] is a {type(chunk).__name__}: wrap it in "
                f"mp_optim.{wrapper.__name__} first (the config's fully_sharded="
                f"{config.fully_sharded})"
            )
        if chunk.config is not config and (
            chunk.config.use_distributed_optimizer != config.use_distributed_optimizer
        ):
            raise ValueError(
                f"model_chunks[{i}] was wrapped with use_distributed_optimizer="
                f"{chunk.config.use_distributed_optimizer}, the optimizer config says "
                f"{config.use_distributed_optimizer}"
            )
    groups = get_param_groups(
        model_chunks, config, no_weight_decay_cond=no_weight_decay_cond,
        scale_lr_cond=scale_lr_cond, lr_mult=lr_mult, mup_width_mult=mup_width_mult,
    )  # fmt: skip
    return MixedPrecisionOptimizer(
        config, model_chunks, groups, mp_group=mp_group, expert_mp_group=expert_mp_group,
        tp_group=tp_group, expert_tp_group=expert_tp_group,
    )  # fmt: skip
