"""Megatron's --check-weight-hash-across-dp-replicas-interval: every N iterations, each
parameter's bytes must be the same on every data-parallel replica.

    check_weight_replicas(run.model)   # collective over every data-parallel group

A replica that drifted (a missed all-reduce, a non-deterministic kernel applied on one
rank, a bit flip in memory) otherwise trains on unnoticed. Each rank hashes each of its
parameters (sha256 of the bytes, after any parameter all-gather still running), the
digests are gathered over the ranks that hold the same parameter (the chunk's
data-parallel group, context-parallel ranks included; expert parameters over the
expert data-parallel group), and any difference raises, naming the parameters and the
ranks that disagree. Under FSDP the ranks hold different rows: there is nothing to
compare, and the flag is refused there (run_checks).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from mp_optim import is_expert_parallel

__all__ = ["check_weight_replicas"]


def check_weight_replicas(model_chunks: list) -> None:
    """Raises RuntimeError when a parameter differs between its data-parallel replicas."""
    differing = []
    for chunk in model_chunks:
        chunk.finish_param_sync()
        params = list(chunk.module.named_parameters())
        for expert, group in ((False, chunk.dp_group), (True, chunk.expert_dp_group)):
            if group is None or group.size == 1:
                continue
            mine = [(name, _digest(p)) for name, p in params if is_expert_parallel(p) == expert]
            everyone: list = [None] * group.size
            dist.all_gather_object(everyone, mine, group=group.group)
            for i, (name, _) in enumerate(mine):
                digests = {rank: theirs[i][1] for rank, theirs in zip(group.ranks, everyone,
                                                                      strict=True)}  # fmt: skip
                if len(set(digests.values())) > 1:
                    ranks = [r for r, d in digests.items() if d != digests[group.ranks[0]]]
                    differing.append(f"{name} (ranks {ranks} differ from rank {group.ranks[0]})")
    if differing:
        raise RuntimeError(
            f"rank {dist.get_rank()}: {len(differing)} parameters differ between their "
            f"data-parallel replicas: {', '.join(differing[:10])}"
            f"{' ...' if len(differing) > 10 else ''}"
        )


def _digest(param: torch.Tensor) -> str:
    data = param.detach().contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
