"""A torch.distributed world of any size inside one process, for rank-group logic.

torch's fake backend answers every collective without communicating, so one
process can play any rank of a 1024-rank world: create groups, query ranks and
sizes. Numbers that collectives return are meaningless; use it to test who is
in which group, never what a collective computes (`run_on_ranks` does that).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["fake_world"]


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initializes the default process group as `rank` of `world_size` fake ranks."""
    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside a world of size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
