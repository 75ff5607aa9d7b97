"""initialize() on real gloo ranks: the groups equal RankGenerator's and reach their members."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_state import ParallelConfig, RankGenerator, current, destroy, initialize
from mp_state.testing import fake_world, run_on_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = {
    1: [{}],
    2: [
        dict(tensor_model_parallel_size=2),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        dict(context_parallel_size=2),
        dict(expert_model_parallel_size=2),
        dict(order="dp-tp"),
    ],
    4: [
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, context_parallel_size=2),
        dict(pipeline_model_parallel_size=2, order="pp-dp"),
        dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
             expert_tensor_parallel_size=1),
        dict(expert_model_parallel_size=2, order="tp-cp-dp-ep-pp"),
    ],
    8: [
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
             expert_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp"),
        dict(tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2,
             expert_model_parallel_size=2, expert_tensor_parallel_size=1),
        dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
             order="pp-tp-dp"),
    ],
}  # fmt: skip

DENSE = {"tp": "tp", "pp": "pp", "dp": "dp", "dp_gloo": "dp", "dp_cp": "dp-cp",
         "dp_cp_gloo": "dp-cp", "cp": "cp", "mp": "tp-pp", "tp_dp": "tp-dp",
         "tp_dp_cp": "tp-dp-cp", "tp_cp": "tp-cp"}  # fmt: skip
EXPERT = {"ep": "ep", "expert_tp": "tp", "expert_dp": "dp", "expert_dp_gloo": "dp",
          "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp"}  # fmt: skip


def build_and_probe(layouts: list[dict]) -> list[dict[str, tuple[int, ...] | None]]:
    """On each rank: initialize every layout, probe each group with a collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    seen = []
    for kwargs in layouts:
        state = initialize(ParallelConfig(**kwargs))
        assert current() is state
        held: dict[str, tuple[int, ...] | None] = {}
        for kind, group in state.groups().items():
            # Each member adds (its group rank + 1) at its global rank: the sum shows
            # exactly who took part, and in which order the group numbers them.
            probe = torch.zeros(world)
            probe[rank] = group.rank + 1
            dist.all_reduce(probe, group=group.group)
            expected = torch.zeros(world)
            for i, member in enumerate(group.ranks):
                expected[member] = i + 1
            assert torch.equal(probe, expected), (kwargs, kind, probe.tolist(), group.ranks)
            held[kind] = group.ranks
        held.setdefault("embedding", None)
        held.setdefault("position_embedding", None)
        seen.append(held)
        destroy()
    return seen


def expected_groups(world: int, kwargs: dict) -> dict[str, list[list[int]]]:
    """The groups straight from two RankGenerators, as megatron-core builds them."""
    c = ParallelConfig(**kwargs)
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    cp, dp = c.context_parallel_size, c.data_parallel_size(world)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=c.order)
    expert = RankGenerator(
        tp=c.expert_tensor_parallel_size, ep=c.expert_model_parallel_size,
        dp=c.expert_data_parallel_size(world), pp=pp, cp=1, order=c.order,
    )  # fmt: skip
    groups = {kind: dense.get_ranks(token) for kind, token in DENSE.items()}
    groups |= {kind: expert.get_ranks(token) for kind, token in EXPERT.items()}
    return groups


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_groups_equal_rank_generator_and_reach_exactly_their_members(world):
    per_rank = run_on_ranks(build_and_probe, world, LAYOUTS[world], timeout=120)
    for i, kwargs in enumerate(LAYOUTS[world]):
        for kind, groups in expected_groups(world, kwargs).items():
            for rank in range(world):
                mine = next(g for g in groups if rank in g)
                assert per_rank[rank][i][kind] == tuple(mine), (kwargs, kind, rank)


def test_megatron_example_tp2_pp2_dp2_on_8_gloo_ranks():
    per_rank = run_on_ranks(
        build_and_probe, 8, [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)]
    )
    held = [r[0] for r in per_rank]

    def groups(kind):
        return sorted({g for g in (h[kind] for h in held) if g is not None})

    assert groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups("mp") == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert groups("tp_dp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups("embedding") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups("position_embedding") == [(0,), (1,), (2,), (3,)]
    assert [h["position_embedding"] for h in held[4:]] == [None] * 4


def test_megatron_example_tp2_pp4_dp2_order_tp_dp_pp_on_16_gloo_ranks():
    per_rank = run_on_ranks(
        build_and_probe, 16,
        [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, order="tp-dp-pp")],
    )  # fmt: skip
    held = [r[0] for r in per_rank]

    def groups(kind):
        return sorted({h[kind] for h in held if h[kind] is not None})

    assert groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert groups("pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert groups("embedding") == [(0, 12), (1, 13), (2, 14), (3, 15)]
    # Middle stages hold no embedding group.
    assert [held[r]["embedding"] for r in (4, 8, 5, 11)] == [None] * 4


def stage_queries() -> list:
    state = initialize(
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3)
    )
    answers = [
        state.is_pipeline_first_stage(),
        state.is_pipeline_last_stage(),
        [state.is_pipeline_first_stage(v) for v in range(3)],
        [state.is_pipeline_last_stage(v) for v in range(3)],
        [state.virtual_pipeline_stage_index(v) for v in range(3)],
    ]
    try:
        state.is_pipeline_first_stage(3)
    except ValueError as err:
        answers.append(str(err))
    destroy()
    return answers


def test_pipeline_stage_queries_with_virtual_stages():
    first, last = run_on_ranks(stage_queries, 2)
    assert first[:5] == [True, False, [True, False, False], [False] * 3, [0, 2, 4]]
    assert last[:5] == [False, True, [False] * 3, [False, False, True], [1, 3, 5]]
    assert "vp_stage=3 is outside 0..2" in first[5]


def reinitialize_and_reuse() -> list[str]:
    errors = []
    state = initialize(ParallelConfig(tensor_model_parallel_size=2))
    try:
        initialize(ParallelConfig())
    except RuntimeError as err:
        errors.append(str(err))
    destroy()
    try:
        current()
    except RuntimeError as err:
        errors.append(str(err))
    # After destroy, another layout can be built in the same world.
    state = initialize(ParallelConfig(pipeline_model_parallel_size=2))
    assert state.pp.size == 2 and state.tp.size == 1
    destroy()
    return errors


def test_initialize_twice_is_an_error_and_destroy_allows_a_new_layout():
    errors = run_on_ranks(reinitialize_and_reuse, 2)[0]
    assert "already initialized" in errors[0]
    assert "not initialized" in errors[1]


def test_initialize_needs_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        initialize(ParallelConfig())


def test_current_without_initialize_is_an_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        mp_state.current()


def test_gloo_twins_share_the_group_on_a_cpu_backend_and_destroy_clears_current():
    with fake_world(4, 1):
        state = initialize(ParallelConfig(tensor_model_parallel_size=2))
        assert state.dp_gloo.group is state.dp.group
        assert state.tp_dp.group is not dist.GroupMember.WORLD  # a group of its own
        assert current() is state
        destroy()
        with pytest.raises(RuntimeError):
            current()


def test_no_gloo_twins_when_disabled():
    with fake_world(4, 1):
        state = initialize(ParallelConfig(tensor_model_parallel_size=2,
                                          disable_gloo_process_groups=True))  # fmt: skip
        assert (state.dp_gloo, state.dp_cp_gloo, state.expert_dp_gloo) == (None, None, None)
        assert state.dp is not None
        destroy()


def cycle_without_collectives(cycles: int) -> int:
    # No collective between creating and destroying: destroy() itself must keep a
    # fast rank from closing a group while a slow peer is still connecting to it.
    config = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for _ in range(cycles):
        initialize(config)
        destroy()
    return cycles


def test_initialize_then_destroy_at_once_many_times():
    assert run_on_ranks(cycle_without_collectives, 8, 15, timeout=120) == [15] * 8
