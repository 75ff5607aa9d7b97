"""ParallelConfig and plan_groups: every invalid layout raises ValueError naming its values."""

import pytest

from mp_state import ParallelConfig, plan_groups


def test_defaults_are_megatrons():
    c = ParallelConfig()
    assert c.order == "tp-cp-ep-dp-pp"
    assert c.virtual_pipeline_model_parallel_size is None
    assert c.distributed_timeout_minutes == 10
    assert c.data_parallel_size(8) == 8


def test_expert_tensor_parallel_size_defaults_to_tp():
    assert ParallelConfig(tensor_model_parallel_size=4).expert_tensor_parallel_size == 4
    c = ParallelConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert c.expert_tensor_parallel_size == 1


def test_data_parallel_sizes_are_derived_from_the_world():
    c = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    assert c.data_parallel_size(32) == 4
    # 2*2*4 = 16 dense ranks per stage re-divided as 1 (etp) x 4 (ep) x 4 (edp).
    assert c.expert_data_parallel_size(32) == 4


@pytest.mark.parametrize(
    ("kwargs", "world", "message"),
    [
        (
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            6,
            r"world size 6 is not divisible by tensor_model_parallel_size=2 "
            r"x pipeline_model_parallel_size=2 x context_parallel_size=1 = 4",
        ),
        (
            dict(tensor_model_parallel_size=1, context_parallel_size=3),
            8,
            r"world size 8 .*context_parallel_size=3",
        ),
        (
            dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
            6,
            r"data_parallel_size=3 \(world size 6\) is not divisible by "
            r"expert_model_parallel_size=2",
        ),
        (
            dict(
                tensor_model_parallel_size=2,
                expert_model_parallel_size=4,
                expert_tensor_parallel_size=2,
                context_parallel_size=1,
            ),
            12,
            r"data_parallel_size=6 .*expert_model_parallel_size=4",
        ),
        (
            dict(
                tensor_model_parallel_size=1,
                context_parallel_size=2,
                expert_model_parallel_size=3,
                expert_tensor_parallel_size=1,
            ),
            4,
            r"context_parallel_size=2 x data_parallel_size=2 = 4 ranks .*"
            r"expert_model_parallel_size=3",
        ),
    ],
)
def test_layouts_that_do_not_fit_the_world(kwargs, world, message):
    config = ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        plan_groups(config, world)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(virtual_pipeline_model_parallel_size=2),
            r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1",
        ),
        (dict(order="tp-cp-xp-dp-pp"), r"order='tp-cp-xp-dp-pp' has unknown token\(s\) \['xp'\]"),
        (dict(order="tp-dp-tp-pp"), r"order='tp-dp-tp-pp' repeats token\(s\) \['tp'\]"),
        (
            dict(pipeline_model_parallel_size=4, order="tp-dp"),
            r"order='tp-dp' leaves out pp=4",
        ),
        (
            dict(expert_tensor_parallel_size=2, order="dp-pp"),
            r"order='dp-pp' leaves out tp=2",
        ),
        (dict(tensor_model_parallel_size=0), r"tensor_model_parallel_size=0 must be a positive"),
        (dict(pipeline_model_parallel_size=-1), r"pipeline_model_parallel_size=-1"),
        (dict(context_parallel_size=1.5), r"context_parallel_size=1.5"),
        (dict(expert_model_parallel_size=True), r"expert_model_parallel_size=True"),
        (dict(distributed_timeout_minutes=0), r"distributed_timeout_minutes=0"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0),
            r"virtual_pipeline_model_parallel_size=0",
        ),
        (
            dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 1]),
            r"hierarchical_context_parallel_sizes=\[2, 1\]: their product must be "
            r"context_parallel_size=4",
        ),
        (
            dict(context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2]),
            r"has two levels, \[all-to-all, ring\]",
        ),
    ],
)
def test_invalid_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_dp_size_missing_from_the_order_is_caught_with_the_world():
    config = ParallelConfig(tensor_model_parallel_size=2, order="tp-pp")
    assert plan_groups(config, 2).data_parallel_size == 1
    with pytest.raises(ValueError, match=r"order='tp-pp' leaves out dp=2"):
        plan_groups(config, 4)


def test_pp_not_last_needs_equal_dense_and_expert_data_parallel_sizes():
    config = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        order="tp-cp-ep-dp-pp",
    )
    plan_groups(config, 8)  # pp last: fine
    bad = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        order="tp-pp-ep-dp",
    )
    with pytest.raises(ValueError, match=r"does not put 'pp' last.*size \(2\).*size \(4\)"):
        plan_groups(bad, 16)


def test_expert_parallelism_under_megatrons_tp_pp_dp_mapping():
    """--use-tp-pp-dp-mapping (order tp-cp-ep-pp-dp) with CP2 x EP2 x PP2 on 8 ranks, as
    Megatron-LM's functional test moe/gpt3_mcore_cp2_pp2_ep2_..._dp_last runs it: the
    experts split over the context-parallel pairs, each replica 4 ranks away; the groups
    are megatron-core 0.19.2's RankGenerator's for the same sizes."""
    config = ParallelConfig(
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        order="tp-cp-ep-pp-dp",
    )
    plan = plan_groups(config, 8)
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7)]
    replicas = [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert plan.data_parallel_size == plan.expert_data_parallel_size == 2
    assert plan.groups["cp"] == pairs
    assert plan.groups["ep"] == pairs
    assert plan.groups["pp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert plan.groups["dp"] == replicas
    assert plan.groups["expert_dp"] == replicas
    assert plan.groups["dp_cp"] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_distributed_optimizer_instances_slice_the_data_parallel_groups():
    """num_distributed_optimizer_instances=2 at TP2 x DP4 x EP2 on 8 ranks: Megatron's
    partial distributed-optimizer groups, consecutive slices of each dp_cp group and the
    ranks one slice apart; the expert dp groups sliced alike."""
    config = ParallelConfig(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        num_distributed_optimizer_instances=2,
    )
    plan = plan_groups(config, 8)
    assert plan.groups["dp_cp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.groups["intra_dp_cp"] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert plan.groups["inter_dp_cp"] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    # expert TP 1 x EP 2: the experts split over (0, 1), (2, 3), ...; their replicas
    assert plan.groups["expert_dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.groups["intra_expert_dp"] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert plan.groups["inter_expert_dp"] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert "intra_dp_cp" not in plan_groups(ParallelConfig(), 8).groups
    with pytest.raises(
        ValueError,
        match=r"num_distributed_optimizer_instances=3 must divide "
        r"the data-parallel x context-parallel size \(4\)",
    ):
        plan_groups(ParallelConfig(num_distributed_optimizer_instances=3), 4)


def test_embedding_rank_function_must_pick_stage_ranks():
    config = ParallelConfig(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"embedding ranks \[99\]"):
        plan_groups(config, 2, embedding_ranks=lambda pp_ranks: [99])
    with pytest.raises(ValueError, match=r"position embedding ranks \[\]"):
        plan_groups(config, 2, position_embedding_ranks=lambda pp_ranks: [])


def test_hierarchical_context_parallel_groups_are_megatrons():
    """Megatron's create_hierarchical_groups over each CP group: the inner (all-to-all)
    groups of consecutive CP ranks, the outer (ring) ones of ranks `inner` apart."""
    config = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=4,
                            hierarchical_context_parallel_sizes=[2, 2])  # fmt: skip
    plan = plan_groups(config, 16)
    assert plan.groups["cp"][:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.groups["cp_a2a"][:4] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert plan.groups["cp_p2p"][:4] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    for kind in ("cp_a2a", "cp_p2p"):
        ranks = sorted(r for group in plan.groups[kind] for r in group)
        assert ranks == list(range(16))
    assert "cp_a2a" not in plan_groups(ParallelConfig(context_parallel_size=4), 4).groups
