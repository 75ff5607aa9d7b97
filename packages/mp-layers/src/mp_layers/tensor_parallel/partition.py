"""How a dimension is divided among the ranks of a group.

Every split in tensor and sequence parallelism is an equal, contiguous one:
rank r of a group of size n holds elements [r * size / n, (r + 1) * size / n)
of the split dimension. These helpers compute that, and refuse, with the
argument's name and value, a size that does not divide.
"""

from __future__ import annotations

import torch

from mp_state import RankGroup

__all__ = ["divide", "mark_partitioned", "partition_range"]


def divide(value: int, group: RankGroup, name: str) -> int:
    """value / group.size, or a ValueError naming `name` when it does not divide.

    `name` is what the caller calls the value (an argument such as
    "output_size", or a dimension such as "logits.shape[-1]"), so the message
    says which one to change.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if value % group.size:
        raise ValueError(
            f"{name}={value} is not divisible by the size of the {group.kind} group ({group.size})"
        )
    return value // group.size


def partition_range(size_per_rank: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous piece when each rank holds size_per_rank."""
    start = rank * size_per_rank
    return start, start + size_per_rank


def mark_partitioned(param: torch.nn.Parameter, dim: int, group: RankGroup) -> None:
    """Marks `param` as this rank's piece of a matrix split along `dim` over `group`, for an
    optimizer that needs whole matrices (mp_optim's Muon): Megatron's `partition_dim`, and
    mp's `partition_group_kind` (the group's kind, "tp" or "expert_tp", which the
    optimizer is given). Nothing is marked when the group is one rank. The parameter
    holds no process group, so it still pickles."""
    if group.size > 1:
        param.partition_dim = dim
        param.partition_group_kind = group.kind
