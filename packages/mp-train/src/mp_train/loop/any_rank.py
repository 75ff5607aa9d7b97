"""Flags agreed over every rank: the loop's collective decisions (a nan on any rank, a rerun
any rank asks for, a checkpoint state every rank can take)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["any_rank"]


def any_rank(flags: list[bool]) -> list[bool]:
    """Each flag: whether it is set on any rank (collective: one MAX all-reduce)."""
    values = torch.tensor([float(f) for f in flags])
    if dist.get_backend() == "nccl":
        values = values.cuda()
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(v > 0) for v in values.tolist()]
