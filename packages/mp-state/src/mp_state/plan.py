"""The rank groups of a run, planned without any process group.

`plan_groups` lists, for each kind of group Megatron creates for dense and MoE
training, every group as a tuple of global ranks. `initialize` turns this plan
into process groups; tests check the plan itself at thousands of ranks.

Dense groups come from a generator with ep=1 over the run's order; expert
groups from a second generator over the same order with tp=expert_tp, ep,
dp=expert_dp and cp=1, as in current megatron-core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mp_state.config import ParallelConfig
from mp_state.rank_generator import RankGenerator

__all__ = [
    "DENSE_TOKENS",
    "EXPERT_TOKENS",
    "GroupPlan",
    "RanksFn",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "plan_groups",
]

RanksFn = Callable[[Sequence[int]], Sequence[int]]
"""Given one pipeline group's ranks (stage order), the ranks that hold an embedding."""

DENSE_TOKENS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp_dp": "tp-dp",
    "tp_dp_cp": "tp-dp-cp",
    "tp_cp": "tp-cp",
}
"""Group kind -> RankGenerator token, for the dense (attention and MLP) layers."""

EXPERT_TOKENS = {
    "ep": "ep",
    "expert_tp": "tp",
    "expert_dp": "dp",
    "tp_ep": "tp-ep",
    "tp_ep_pp": "tp-ep-pp",
}
"""Group kind -> token of the expert generator, for MoE layers."""


def default_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """Word embeddings live on the first and last stage (tied input/output embedding)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> list[int]:
    """Learned position embeddings live on the first stage only."""
    return [pp_ranks[0]]


@dataclass(frozen=True)
class GroupPlan:
    """Every group of a run: kind -> groups, each a tuple of global ranks in group order."""

    world_size: int
    data_parallel_size: int
    expert_data_parallel_size: int
    groups: dict[str, list[tuple[int, ...]]]

    def group_of(self, kind: str, rank: int) -> tuple[int, ...] | None:
        """The group of `kind` that holds `rank`, or None (embedding groups skip middle stages)."""
        for ranks in self.groups[kind]:
            if rank in ranks:
                return ranks
        return None


def plan_groups(
    config: ParallelConfig,
    world_size: int,
    embedding_ranks: RanksFn = default_embedding_ranks,
    position_embedding_ranks: RanksFn = default_position_embedding_ranks,
) -> GroupPlan:
    """Plans every group for `world_size` ranks, or raises ValueError naming the values."""
    dp = config.data_parallel_size(world_size)
    edp = config.expert_data_parallel_size(world_size)
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    dense = RankGenerator(
        tp=tp, ep=1, dp=dp, pp=pp, cp=config.context_parallel_size, order=config.order
    )
    expert = RankGenerator(
        tp=config.expert_tensor_parallel_size,
        ep=config.expert_model_parallel_size,
        dp=edp,
        pp=pp,
        cp=1,
        order=config.order,
    )
    if dense.axes[-1] != "pp" and pp > 1 and edp != dp:
        raise ValueError(
            f"order={config.order!r} does not put 'pp' last, which needs the expert data-parallel "
            f"size ({edp}) to equal the data-parallel size ({dp})"
        )
    groups = {kind: _tuples(dense.get_ranks(tok)) for kind, tok in DENSE_TOKENS.items()}
    groups |= {kind: _tuples(expert.get_ranks(tok)) for kind, tok in EXPERT_TOKENS.items()}
    if groups["pp"] != _tuples(expert.get_ranks("pp")):
        raise ValueError(
            f"order={config.order!r} gives different pipeline groups to dense and expert layers "
            f"(tensor_model_parallel_size={tp}, expert_tensor_parallel_size="
            f"{config.expert_tensor_parallel_size}); put 'pp' last in the order"
        )
    if config.hierarchical_context_parallel_sizes is not None:
        groups |= _hierarchical_cp(groups["cp"], config.hierarchical_context_parallel_sizes)
    instances = config.num_distributed_optimizer_instances
    if instances > 1:
        groups |= _optimizer_instances(groups["dp_cp"], instances, "dp_cp")
        groups |= _optimizer_instances(groups["expert_dp"], instances, "expert_dp")
    groups["embedding"] = [_stage_subset(p, embedding_ranks, "embedding") for p in groups["pp"]]
    groups["position_embedding"] = [
        _stage_subset(p, position_embedding_ranks, "position embedding") for p in groups["pp"]
    ]
    return GroupPlan(world_size, dp, edp, groups)


def _hierarchical_cp(cp_groups: list[tuple[int, ...]], sizes: list[int]) -> dict:
    """Megatron's hierarchical context-parallel groups of each CP group (its
    create_hierarchical_groups): "cp_a2a", `inner` consecutive CP ranks; "cp_p2p", the
    ranks `inner` apart."""
    inner, outer = sizes
    return {
        "cp_a2a": [g[i * inner : (i + 1) * inner] for g in cp_groups for i in range(outer)],
        "cp_p2p": [g[i::inner] for g in cp_groups for i in range(inner)],
    }


def _optimizer_instances(replicas: list[tuple[int, ...]], instances: int, kind: str) -> dict:
    """Megatron's partial distributed-optimizer groups of each `kind` group: "intra_<kind>",
    `instances` consecutive slices of it; "inter_<kind>", the ranks one slice apart."""
    size = len(replicas[0])
    if size % instances:
        what = "data-parallel x context-parallel" if kind == "dp_cp" else "expert data-parallel"
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} must divide the {what} size ({size})"
        )
    inner = size // instances
    return {
        f"intra_{kind}": [g[i * inner : (i + 1) * inner] for g in replicas
                          for i in range(instances)],
        f"inter_{kind}": [g[i::inner] for g in replicas for i in range(inner)],
    }  # fmt: skip


def _tuples(groups: list[list[int]]) -> list[tuple[int, ...]]:
    return [tuple(g) for g in groups]


def _stage_subset(pp_ranks: tuple[int, ...], fn: RanksFn, what: str) -> tuple[int, ...]:
    chosen = tuple(fn(pp_ranks))
    stray = [r for r in chosen if r not in pp_ranks]
    if not chosen or stray or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"the {what} ranks {list(chosen)} chosen for pipeline group {list(pp_ranks)} must be "
            "a non-empty set of distinct ranks of that group"
        )
    # torch numbers a group's members in ascending global rank.
    return tuple(sorted(chosen))
