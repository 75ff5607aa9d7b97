"""ParallelState: every process group of a run, created once by `initialize`.

Group kinds, as Megatron names them (the plan module lists their tokens):

    tp, pp, dp, cp            tensor-, pipeline-, data-, context-parallel
    dp_cp                     data-parallel with context-parallel ranks (gradient reduction)
    mp                        model-parallel: tp x pp
    tp_dp, tp_dp_cp, tp_cp    combined groups
    ep, expert_tp, expert_dp  expert-parallel groups of MoE layers
    tp_ep, tp_ep_pp           expert tensor x expert model (x pipeline)
    embedding                 first and last stage of each pipeline (tied embeddings)
    position_embedding        first stage of each pipeline
    dp_gloo, dp_cp_gloo, expert_dp_gloo   gloo twins of the data-parallel groups

Each rank holds the one group of each kind it belongs to. Kinds with the same
members share one process group (when cp = 1, dp_cp is dp; when tp = 1, tp_dp
is dp): each distinct set of ranks costs one communicator, not one per kind,
which keeps start-up fast and, on GPUs, spares the memory every NCCL
communicator takes. The gloo twins are separate gloo groups only when the
main backend is not already a CPU one, and none are made with
ParallelConfig.disable_gloo_process_groups (Megatron's --disable-gloo-process-groups).

A group that spans the whole world is still a group of its own, not the
default group: `destroy()` then destroys everything the state holds, and a
ParallelState that outlives `torch.distributed.destroy_process_group()` holds
no live process group. (With torch 2.15 and gloo, a live group whose last
reference goes only at interpreter exit can abort the process there with
"terminate called without an active exception".)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from mp_state.config import ParallelConfig
from mp_state.plan import (
    GroupPlan,
    RanksFn,
    default_embedding_ranks,
    default_position_embedding_ranks,
    plan_groups,
)

__all__ = ["ParallelState", "RankGroup", "current", "destroy", "initialize"]

_GLOO_TWINS = {"dp_gloo": "dp", "dp_cp_gloo": "dp_cp", "expert_dp_gloo": "expert_dp"}
_current: ParallelState | None = None


@dataclass(frozen=True)
class RankGroup:
    """One group as seen from this rank."""

    kind: str
    """Which group this is (tp, pp, dp, ...)."""

    ranks: tuple[int, ...]
    """Global ranks of the members, in the order of their rank inside the group."""

    rank: int
    """This process's rank inside the group."""

    group: dist.ProcessGroup = field(repr=False, compare=False)
    """The process group to pass to collectives."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank]


@dataclass(frozen=True)
class ParallelState:
    """Every group this rank belongs to, and the layout they came from."""

    config: ParallelConfig
    plan: GroupPlan = field(repr=False)
    rank: int
    tp: RankGroup
    pp: RankGroup
    dp: RankGroup
    dp_gloo: RankGroup | None
    dp_cp: RankGroup
    dp_cp_gloo: RankGroup | None
    cp: RankGroup
    mp: RankGroup
    tp_dp: RankGroup
    tp_dp_cp: RankGroup
    tp_cp: RankGroup
    ep: RankGroup
    expert_tp: RankGroup
    expert_dp: RankGroup
    expert_dp_gloo: RankGroup | None
    """The gloo twins are None with ParallelConfig.disable_gloo_process_groups."""
    tp_ep: RankGroup
    tp_ep_pp: RankGroup
    embedding: RankGroup | None
    """None on ranks that hold no word embedding (middle pipeline stages)."""
    position_embedding: RankGroup | None
    """None on ranks that hold no position embedding."""
    cp_a2a: RankGroup | None = None
    """With hierarchical_context_parallel_sizes: the inner CP group (consecutive CP ranks,
    all-to-all by heads); else None."""
    cp_p2p: RankGroup | None = None
    """With hierarchical_context_parallel_sizes: the outer CP group (a ring); else None."""
    intra_dp_cp: RankGroup | None = None
    """With num_distributed_optimizer_instances > 1: this rank's slice of dp_cp, over
    which the distributed optimizer shards dense parameters; else None."""
    inter_dp_cp: RankGroup | None = None
    """With num_distributed_optimizer_instances > 1: the ranks at this rank's position in
    every slice of dp_cp (its replicas of the optimizer shard); else None."""
    intra_expert_dp: RankGroup | None = None
    """As intra_dp_cp, of expert_dp."""
    inter_expert_dp: RankGroup | None = None
    """As inter_dp_cp, of expert_dp."""

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def virtual_pipeline_size(self) -> int | None:
        return self.config.virtual_pipeline_model_parallel_size

    def groups(self) -> dict[str, RankGroup]:
        """Kind -> group, for every group this rank belongs to."""
        return {name: value for name, value in vars(self).items() if isinstance(value, RankGroup)}

    def is_pipeline_first_stage(self, vp_stage: int | None = None) -> bool:
        """First pipeline stage; with virtual stages, only for model chunk vp_stage == 0.

        vp_stage=None asks about the physical stage, ignoring virtual chunks.
        """
        self._check_vp_stage(vp_stage)
        return self.pp.rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_pipeline_last_stage(self, vp_stage: int | None = None) -> bool:
        """Last pipeline stage; with virtual stages, only for the last model chunk."""
        self._check_vp_stage(vp_stage)
        last_chunk = (self.virtual_pipeline_size or 1) - 1
        return self.pp.rank == self.pp.size - 1 and (vp_stage is None or vp_stage == last_chunk)

    def virtual_pipeline_stage_index(self, vp_stage: int) -> int:
        """Position of this rank's chunk vp_stage among all pp x vpp model chunks.

        Megatron's interleaved layout: chunk v of pipeline rank r is stage v * pp + r.
        """
        self._check_vp_stage(vp_stage)
        return vp_stage * self.pp.size + self.pp.rank

    def _check_vp_stage(self, vp_stage: int | None) -> None:
        chunks = self.virtual_pipeline_size or 1
        if vp_stage is not None and not 0 <= vp_stage < chunks:
            raise ValueError(
                f"vp_stage={vp_stage} is outside 0..{chunks - 1} "
                f"(virtual_pipeline_model_parallel_size={self.virtual_pipeline_size})"
            )

    def destroy(self) -> None:
        """Destroys this state's process groups; the default group stays.

        Collective, like `initialize`: every rank calls it. A rank may finish
        creating a gloo group before its peers have completed the handshake;
        the barrier keeps it from closing the group under them.
        """
        global _current
        dist.barrier()
        seen = set()
        for g in self.groups().values():
            if id(g.group) not in seen:
                seen.add(id(g.group))
                dist.destroy_process_group(g.group)
        if _current is self:
            _current = None


def initialize(
    config: ParallelConfig,
    *,
    embedding_ranks: RanksFn = default_embedding_ranks,
    position_embedding_ranks: RanksFn = default_position_embedding_ranks,
) -> ParallelState:
    """Creates every group of `config` over the default process group, on every rank.

    All ranks must call this together, with the same arguments. The result
    also becomes `current()`.
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize() needs torch.distributed to be initialized first "
            "(mp_state.init_distributed() does it from torchrun's environment)"
        )
    if _current is not None:
        raise RuntimeError("mp_state is already initialized; call destroy() first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    plan = plan_groups(config, world_size, embedding_ranks, position_embedding_ranks)
    timeout = timedelta(minutes=config.distributed_timeout_minutes)
    backend = str(dist.get_backend())
    twin_backend = None if ("gloo" in backend or backend == "fake") else "gloo"

    created: dict[tuple[tuple[int, ...], str | None], dist.ProcessGroup] = {}
    mine: dict[str, RankGroup | None] = {}
    kinds = [(kind, kind, None) for kind in plan.groups]
    if config.disable_gloo_process_groups:
        mine |= dict.fromkeys(_GLOO_TWINS)
    else:
        kinds += [(twin, kind, twin_backend) for twin, kind in _GLOO_TWINS.items()]
    # Every rank walks the same kinds and groups in the same order: new_group is
    # collective over the whole world, members or not.
    for name, kind, group_backend in kinds:
        mine[name] = None
        for ranks in plan.groups[kind]:
            key = (ranks, group_backend)
            if key not in created:
                created[key] = dist.new_group(
                    list(ranks), timeout=timeout, backend=group_backend, group_desc=name
                )
            if rank in ranks:
                mine[name] = RankGroup(name, ranks, ranks.index(rank), created[key])
    _current = ParallelState(config=config, plan=plan, rank=rank, **mine)
    return _current


def current() -> ParallelState:
    """The state made by the last `initialize`, for application code."""
    if _current is None:
        raise RuntimeError("mp_state is not initialized: call mp_state.initialize(config)")
    return _current


def destroy() -> None:
    """Destroys the current state's groups, if any."""
    if _current is not None:
        _current.destroy()
