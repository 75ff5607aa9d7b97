"""Rank groups at 64, 256 and 1024 ranks, in one process.

The plan is checked over every rank; `initialize` itself runs on torch's fake
backend as every rank at 64 (a sample of 32, the first and last among them, at
256 and 1024: each initialize makes every group of the world, about 10 ms at 256
ranks and 40 ms at 1024) and must hold exactly the plan's groups.
"""

import random

import pytest

from mp_state import ParallelConfig, initialize, plan_groups
from mp_state.testing import fake_world

LAYOUTS = {
    64: [
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4),
        dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            context_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
        ),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order="tp-pp-dp"),
    ],
    256: [
        dict(
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=3,
        ),
        dict(
            tensor_model_parallel_size=4,
            context_parallel_size=4,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=8,
        ),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=8, order="pp-tp-cp-dp-ep"),
    ],
    1024: [
        dict(
            tensor_model_parallel_size=8,
            pipeline_model_parallel_size=8,
            context_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
        ),
        dict(
            tensor_model_parallel_size=4,
            pipeline_model_parallel_size=4,
            expert_model_parallel_size=16,
            expert_tensor_parallel_size=2,
        ),
    ],
}
CASES = [(world, kw) for world, layouts in LAYOUTS.items() for kw in layouts]
PARTITIONS = [
    "tp", "pp", "dp", "dp_cp", "cp", "mp", "tp_dp", "tp_dp_cp", "tp_cp",
    "ep", "expert_tp", "expert_dp", "tp_ep", "tp_ep_pp",
]  # fmt: skip


def expected_sizes(c: ParallelConfig, world: int) -> dict[str, int]:
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    cp = c.context_parallel_size
    ep, etp = c.expert_model_parallel_size, c.expert_tensor_parallel_size
    dp, edp = c.data_parallel_size(world), c.expert_data_parallel_size(world)
    return {
        "tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp_cp": dp * cp, "mp": tp * pp,
        "tp_dp": tp * dp, "tp_dp_cp": tp * dp * cp, "tp_cp": tp * cp,
        "ep": ep, "expert_tp": etp, "expert_dp": edp, "tp_ep": etp * ep, "tp_ep_pp": etp * ep * pp,
    }  # fmt: skip


def by_rank(groups: list[tuple[int, ...]], world: int) -> list[tuple[int, ...]]:
    """rank -> its group, failing unless every rank is in exactly one group."""
    owner: list[tuple[int, ...] | None] = [None] * world
    for g in groups:
        for r in g:
            assert owner[r] is None, f"rank {r} is in {owner[r]} and {g}"
            owner[r] = g
    missing = [r for r, g in enumerate(owner) if g is None]
    assert not missing, f"ranks {missing[:8]} are in no group"
    return owner


@pytest.mark.parametrize(("world", "kwargs"), CASES)
def test_every_rank_is_in_one_group_of_each_kind_of_the_right_size(world, kwargs):
    config = ParallelConfig(**kwargs)
    plan = plan_groups(config, world)
    sizes = expected_sizes(config, world)
    for kind in PARTITIONS:
        groups = plan.groups[kind]
        by_rank(groups, world)
        assert {len(g) for g in groups} == {sizes[kind]}, kind
        assert len(groups) == world // sizes[kind], kind


@pytest.mark.parametrize(("world", "kwargs"), CASES)
def test_groups_are_orthogonal_and_compose(world, kwargs):
    plan = plan_groups(ParallelConfig(**kwargs), world)
    g = {kind: by_rank(plan.groups[kind], world) for kind in PARTITIONS}

    def span(outer: str, inner: str, r: int) -> set[int]:
        return {x for a in g[outer][r] for x in g[inner][a]}

    for r in range(world):
        for a, b in [("tp", "dp"), ("tp", "pp"), ("dp", "pp"), ("tp", "cp"), ("cp", "dp"),
                     ("cp", "pp"), ("expert_tp", "ep"), ("ep", "expert_dp"),
                     ("expert_tp", "expert_dp"), ("ep", "pp")]:  # fmt: skip
            assert set(g[a][r]) & set(g[b][r]) == {r}, (a, b, r)
        assert set(g["mp"][r]) == span("tp", "pp", r)
        assert set(g["tp_dp"][r]) == span("tp", "dp", r)
        assert set(g["dp_cp"][r]) == span("dp", "cp", r)
        assert set(g["tp_cp"][r]) == span("tp", "cp", r)
        assert set(g["tp_dp_cp"][r]) == span("tp_dp", "cp", r)
        assert set(g["tp_ep"][r]) == span("expert_tp", "ep", r)
        assert set(g["tp_ep_pp"][r]) == span("tp_ep", "pp", r)
        # Expert layers re-divide the same ranks of one pipeline stage.
        assert span("tp_ep", "expert_dp", r) == set(g["tp_dp_cp"][r])


@pytest.mark.parametrize(("world", "kwargs"), CASES)
def test_embedding_groups_hold_first_and_last_stage(world, kwargs):
    plan = plan_groups(ParallelConfig(**kwargs), world)
    assert len(plan.groups["embedding"]) == len(plan.groups["pp"])
    for pp, emb, pos in zip(
        plan.groups["pp"], plan.groups["embedding"], plan.groups["position_embedding"], strict=True
    ):
        assert emb == (pp[0], pp[-1])
        assert pos == (pp[0],)


@pytest.mark.parametrize(("world", "kwargs"), CASES)
def test_initialize_on_a_fake_world_holds_the_planned_groups(world, kwargs):
    config = ParallelConfig(**kwargs)
    plan = plan_groups(config, world)
    if world <= 64:
        ranks = range(world)
    else:
        ranks = [0, world - 1, *random.Random(world).sample(range(1, world - 1), 30)]
    for rank in ranks:
        with fake_world(world, rank):
            state = initialize(config)
            try:
                held = state.groups()
                for kind in PARTITIONS:
                    group = held[kind]
                    assert group.ranks == plan.group_of(kind, rank), (kind, rank)
                    assert group.global_rank == rank
                    assert group.group.size() == group.size
                    assert group.group.rank() == group.rank
                for twin, kind in [("dp_gloo", "dp"), ("expert_dp_gloo", "expert_dp")]:
                    assert held[twin].ranks == held[kind].ranks
                pp = state.pp
                assert state.is_pipeline_first_stage() == (pp.rank == 0)
                assert state.is_pipeline_last_stage() == (pp.rank == pp.size - 1)
                assert (state.embedding is not None) == (pp.rank in (0, pp.size - 1))
            finally:
                state.destroy()
