"""Parameters clipped by a gradient norm of their own (Megatron's grad_norm_group).

A parameter tagged `param.grad_norm_group = "mtp"` (mp-layers tags the multi-token
prediction modules' with mtp_detach_heads) is left out of the global gradient norm the
step reports and clips by; the tagged gradients get their own norm, over the same ranks,
and are clipped by it to the same clip_grad. SEPARATE_GRAD_NORM_GROUPS lists the tags
(Megatron's registry); another tag is refused naming the parameter.

Whether a run has a group is decided once, over all ranks (a pipeline stage without the
modules still joins the group's collectives each step): `groups_present`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from mp_state import RankGroup, select_device

__all__ = ["GRAD_NORM_GROUP_ATTR", "SEPARATE_GRAD_NORM_GROUPS", "grad_norm_group", "groups_present"]

GRAD_NORM_GROUP_ATTR = "grad_norm_group"
SEPARATE_GRAD_NORM_GROUPS = ("mtp",)


def grad_norm_group(param: torch.nn.Parameter, name: str | None = None) -> str | None:
    """The parameter's separate group, or None (counted in the global norm)."""
    group = getattr(param, GRAD_NORM_GROUP_ATTR, None)
    if group is not None and group not in SEPARATE_GRAD_NORM_GROUPS:
        where = f"{name}: " if name else ""
        raise ValueError(
            f"{where}grad_norm_group={group!r}: the optimizer clips apart only "
            f"{', '.join(SEPARATE_GRAD_NORM_GROUPS)}"
        )
    return group


def groups_present(local: Iterable[str | None], groups: Sequence[RankGroup]) -> list[str]:
    """The separate groups some rank holds a parameter of (collective over `groups`, whose
    ranks together make the whole world; every rank gets the same list)."""
    held = set(local)
    flags = torch.tensor([float(g in held) for g in SEPARATE_GRAD_NORM_GROUPS],
                         device=select_device().device)  # fmt: skip
    for group in groups:
        if group.size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.group)
    return [g for g, flag in zip(SEPARATE_GRAD_NORM_GROUPS, flags.tolist(), strict=True) if flag]
