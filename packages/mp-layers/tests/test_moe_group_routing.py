"""DeepSeek routing: group-limited top-k with sigmoid scores and the expert bias equals
transformers' DeepseekV3TopkRouter (choice by biased scores, weights from the unbiased
ones, normalized and scaled); the group fields are checked; the global load-balancing
loss counts tokens over its group and over the step's micro-batches (Megatron's rule),
so that on two ranks it adds up to the loss of the whole batch."""

import os

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.moe import TopKRouter, take_metrics
from mp_layers.moe.aux_losses import load_balancing_loss
from mp_state.testing import run_on_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
H = 16
ALONE = ModelGroups.single()


def config(**settings) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, add_bias_linear=False,
                num_moe_experts=8, moe_router_topk=2)  # fmt: skip
    return TransformerConfig(**base | settings)


# (experts, groups, groups per token, top k): DeepSeek-V3's 256 / 8 / 4 / 8 made small
# (groups ranked by their top 2 = k / groups per token, transformers' fixed rule).
HF_SHAPES = [(32, 8, 4, 8), (8, 4, 2, 4)]


@pytest.mark.parametrize(("experts", "groups", "group_topk", "topk"), HF_SHAPES)
def test_group_limited_sigmoid_routing_equals_transformers(experts, groups, group_topk, topk):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = transformers.DeepseekV3Config(
        hidden_size=H, n_routed_experts=experts, n_group=groups, topk_group=group_topk,
        num_experts_per_tok=topk, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(hf_config)
    router = TopKRouter(
        config(num_moe_experts=experts, moe_router_topk=topk, moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_num_groups=groups,
               moe_router_group_topk=group_topk, moe_router_topk_scaling_factor=2.5),
        ALONE.tp,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(experts, H, generator=generator))
        hf.e_score_correction_bias.copy_(torch.randn(experts, generator=generator) * 0.3)
        router.weight.copy_(hf.weight)
        router.expert_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(40, 1, H, generator=generator)
        _, weights, indices = hf(x)
        probs, routing_map = router(x)
    want_map = torch.zeros_like(routing_map).scatter(1, indices, True)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, torch.zeros_like(probs).scatter(1, indices, weights))
    # The groups and the bias matter here: without them other experts win for some tokens.
    plain = (torch.sigmoid(x.reshape(40, H) @ hf.weight.t())).topk(topk).indices
    assert not torch.equal(torch.zeros_like(routing_map).scatter(1, plain, True), routing_map)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(moe_router_num_groups=4), "moe_router_num_groups=4 with moe_router_group_topk="
                                        "None: group-limited routing needs both"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1),
         "moe_router_num_groups=3 does not divide num_moe_experts=8"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=3),
         "moe_router_group_topk=3 exceeds moe_router_num_groups=2"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3),
         "moe_router_topk=3 exceeds the 2 experts of moe_router_group_topk=1 groups of 2"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=3),
         "moe_router_topk=2 is below moe_router_group_topk=3"),
        (dict(moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"]),
         "one coefficient per load-balancing type"),
        (dict(moe_router_load_balancing_type=["aux_loss", "sinkhorn"],
              moe_aux_loss_coeff=[0.01, 0.0]), "sinkhorn is a way to route, not a loss"),
        (dict(moe_router_load_balancing_type=["aux_loss", "aux_loss"],
              moe_aux_loss_coeff=[0.01, 0.1]), "names a type twice"),
        (dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01,
              moe_layer_recompute=True), "'global_aux_loss' with a recomputed router"),
        (dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
              moe_aux_loss_coeff=[0.01, 0.01], moe_layer_recompute=True),
         "'global_aux_loss' with a recomputed router"),
    ],
)  # fmt: skip
def test_group_and_balancing_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        config(**settings)


def test_megatron_forms_that_mean_one_setting_are_accepted():
    # A list of one balancing type and coefficient (Megatron's nargs='+'), and pre-softmax
    # with sigmoid scores, where it does nothing.
    got = config(moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3],
                 moe_router_score_function="sigmoid", moe_router_pre_softmax=True)  # fmt: skip
    assert (got.moe_router_load_balancing_type, got.moe_aux_loss_coeff) == ("seq_aux_loss", 1e-3)
    x = torch.randn(6, 2, H)
    probs = [TopKRouter(config(moe_router_score_function="sigmoid", moe_router_pre_softmax=pre),
                        ALONE.tp, None) for pre in (False, True)]  # fmt: skip
    probs[1].load_state_dict(probs[0].state_dict())
    with torch.no_grad():
        assert torch.equal(probs[0](x)[0], probs[1](x)[0])


def _global_router(group=None) -> TopKRouter:
    torch.manual_seed(3)
    settings = dict(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="global_aux_loss")
    return TopKRouter(config(**settings), ALONE.tp, group)


def _scores_and_counts(router: TopKRouter, x: torch.Tensor):
    scores = torch.softmax(x.reshape(-1, H) @ router.weight.t(), -1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(2).indices, 1.0)
    return scores, chosen.sum(0)


def test_global_aux_loss_averages_the_counts_of_the_steps_micro_batches():
    router = _global_router()
    xs = [torch.randn(4, 2, H) for _ in range(3)]
    for step in range(2):  # the second step starts counting anew
        router.reset_global_counts()
        seen = []
        for x in xs[step:]:
            router(x)
            scores, count = _scores_and_counts(router, x)
            seen.append(count)
            want = load_balancing_loss(scores, torch.stack(seen).mean(0), 8, 2, 8, 1.0)
            torch.testing.assert_close(take_metrics([router])["global_load_balancing_loss"],
                                       want.detach())  # fmt: skip


def _global_on_rank():
    import mp_state
    from mp_state import ParallelConfig

    state = mp_state.initialize(ParallelConfig())
    router = _global_router(ModelGroups.of(state).tp_dp_cp)
    x = torch.randn(2, 6, 2, H, generator=torch.Generator().manual_seed(5))[state.dp.rank]
    router(x)
    return take_metrics([router])["global_load_balancing_loss"]


@pytest.mark.multirank
def test_global_aux_loss_on_two_ranks_adds_up_to_the_whole_batchs_loss():
    losses = run_on_ranks(_global_on_rank, 2, timeout=120)
    router = _global_router()
    x = torch.randn(2, 6, 2, H, generator=torch.Generator().manual_seed(5))
    scores, counts = _scores_and_counts(router, x)
    want = load_balancing_loss(scores, counts, 24, 2, 8, 1.0).detach()
    assert not torch.allclose(losses[0], losses[1])
    torch.testing.assert_close(losses[0] + losses[1], want)
