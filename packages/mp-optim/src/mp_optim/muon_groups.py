"""Which parameters Muon takes, and the optimizer pair for optimizer="muon".

Megatron's rule: Muon orthogonalizes the matrices; the input embedding, the output
layer, and every parameter that is not a matrix (norm weights, biases) go to the scalar
optimizer (Adam), as does a parameter marked `use_muon = False` (Mamba's in_proj, and
here the depthwise convolutions' kernels, which Megatron holds as [C, 1, width]). The
local experts' [experts, out, in] weight is a batch of matrices, one per expert (Megatron
holds a weight per expert).

A parameter's MatrixLayout comes from what mp_layers marks on it: `partition_dim` and
`partition_group_kind` (a matrix split over the tensor-parallel or expert-tensor-parallel
ranks, whose groups the optimizer is given) and `qkv_rows` (a fused query/key/value
weight).
"""

from __future__ import annotations

import torch

from mp_optim.config import OptimizerConfig
from mp_optim.lion import Lion
from mp_optim.muon import MatrixLayout, Muon
from mp_optim.optimizer_chain import ChainedOptimizer
from mp_state import RankGroup

__all__ = ["layout_of", "make_muon_optimizer", "takes_muon"]


def takes_muon(param: torch.Tensor) -> bool:
    """Muon steps this model parameter (else Adam does)."""
    if not getattr(param, "use_muon", True):
        return False
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    if param.dim() == 3:  # the local experts' weights
        return bool(getattr(param, "expert_parallel", False))
    return param.dim() == 2


def layout_of(param: torch.Tensor, groups: dict[str, RankGroup], name: str = "") -> MatrixLayout:
    """How the model parameter holds its matrices (see the module docstring); `groups`
    maps a group kind to this rank's group of that kind."""
    rows = getattr(param, "qkv_rows", None)
    dim, kind = getattr(param, "partition_dim", None), getattr(param, "partition_group_kind", None)
    group = None
    if kind is not None:
        group = groups.get(kind)
        if group is None:
            raise ValueError(
                f"{name or 'a parameter'} is split over the {kind!r} ranks: Muon needs that "
                f"group to orthogonalize it whole (get_optimizer's "
                f"{'expert_tp_group' if kind == 'expert_tp' else 'tp_group'})"
            )
    return MatrixLayout(partition_dim=dim, group=group, qkv_rows=tuple(rows) if rows else None)


def make_muon_optimizer(
    config: OptimizerConfig,
    groups: list[dict],
    model_param_of: dict[int, torch.Tensor],
    partition_groups: dict[str, RankGroup],
    names: dict[int, str] | None = None,
) -> ChainedOptimizer:
    """Muon over the main parameters whose model parameter it takes, fused AdamW (or Lion:
    muon_scalar_optimizer) over the others; `groups` are the main parameters' groups (each
    split between the two, its hyper-parameters kept), model_param_of maps id(main
    parameter) to its model parameter, partition_groups a group kind to this rank's group
    (layout_of), names id(model parameter) to its name (for errors)."""
    matrix_groups, other_groups, layouts = [], [], {}
    for group in groups:
        matrices, others = [], []
        for main in group["params"]:
            param = model_param_of[id(main)]
            if takes_muon(param):
                matrices.append(main)
                name = (names or {}).get(id(param), "")
                layouts[id(main)] = layout_of(param, partition_groups, name)
            else:
                others.append(main)
        matrix_groups.append({**group, "params": matrices})
        other_groups.append({**group, "params": others})
    muon = Muon(
        matrix_groups, lr=config.lr, momentum=config.muon_momentum,
        nesterov=config.muon_nesterov, weight_decay=config.weight_decay,
        num_ns_steps=config.muon_num_ns_steps, coefficient_type=config.muon_coefficient_type,
        scale_mode=config.muon_scale_mode, extra_scale_factor=config.muon_extra_scale_factor,
        matmul_precision=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
        split_qkv=config.muon_split_qkv, layouts=layouts,
    )  # fmt: skip
    if config.muon_scalar_optimizer == "lion":
        scalar = Lion(other_groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2),
                      weight_decay=config.weight_decay)  # fmt: skip
    else:
        scalar = torch.optim.AdamW(
            other_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps, weight_decay=config.weight_decay, fused=True,
        )  # fmt: skip
    return ChainedOptimizer([muon, scalar])
