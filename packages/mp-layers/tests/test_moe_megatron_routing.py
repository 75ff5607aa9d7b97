"""The router against megatron-core 0.19's own routing of the same logits
(assets/megatron_moe/routing.pt, written by assets/megatron_moe/generate.py with
megatron-core installed): top-k choice and weights for every score-function setting,
with and without group-limited routing, the tokens kept under an expert capacity with
both drop policies, the auxiliary losses, Sinkhorn routing (S-BASE) with its
balancing, and quantile balancing (its experts, its column quantile, the weights)."""

from pathlib import Path

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.moe import TopKRouter, capacity_mask, update_quantile_biases
from mp_layers.moe.aux_losses import load_balancing_loss, z_loss
from mp_layers.moe.router import sinkhorn

FIXTURE = torch.load(Path(__file__).parent / "assets" / "megatron_moe" / "routing.pt")
TOKENS, HIDDEN = FIXTURE["x"].shape
EXPERTS, TOPK = FIXTURE["weight"].shape[0], FIXTURE["topk"]
SETTINGS = {  # Megatron's function arguments -> TransformerConfig fields
    "score_function": "moe_router_score_function",
    "use_pre_softmax": "moe_router_pre_softmax",
    "scaling_factor": "moe_router_topk_scaling_factor",
    "num_groups": "moe_router_num_groups",
    "group_topk": "moe_router_group_topk",
}


def router(name: str) -> TopKRouter:
    case = FIXTURE["routing"][name]
    settings = {SETTINGS[k]: v for k, v in case["settings"].items()}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=case["topk"],
        moe_router_enable_expert_bias=name.startswith("sigmoid-bias"), **settings,
    )  # fmt: skip
    module = TopKRouter(config, ModelGroups.single().tp)
    with torch.no_grad():
        module.weight.copy_(FIXTURE["weight"])
        if module.expert_bias is not None:
            module.expert_bias.copy_(FIXTURE["expert_bias"])
    return module


@pytest.mark.parametrize("name", list(FIXTURE["routing"]))
def test_routing_equals_megatrons(name):
    want = FIXTURE["routing"][name]
    with torch.no_grad():
        probs, routing_map = router(name)(FIXTURE["x"].unsqueeze(1))
    assert torch.equal(routing_map, want["routing_map"])
    torch.testing.assert_close(probs, want["probs"])


@pytest.mark.parametrize("case", list(FIXTURE["capacity"]), ids=str)
def test_dropped_tokens_follow_megatrons_rule(case):
    factor, policy, pad = case
    softmax = FIXTURE["routing"]["softmax"]
    keep = capacity_mask(softmax["probs"], softmax["routing_map"], TOPK, factor, policy)
    routing_map = keep if pad else keep & softmax["routing_map"]
    want = FIXTURE["capacity"][case]
    # Every expert keeps as many tokens as Megatron's.
    assert torch.equal(routing_map.sum(0), want["routing_map"].sum(0))
    if policy == "probs":
        assert torch.equal(routing_map, want["routing_map"])
        torch.testing.assert_close(softmax["probs"] * routing_map, want["probs"])
        return
    # "position": Megatron's documented rule drops the tokens at the end of the batch.
    # Its implementation takes a top-k over the 0/1 routing map, and which of the tied
    # tokens that keeps is left to the top-k kernel (on a CPU, not the earliest), so mp
    # keeps the earliest routed tokens of each expert (padding with the earliest others).
    routed = softmax["routing_map"]
    for expert in range(EXPERTS):
        kept = routing_map[:, expert].nonzero().flatten().tolist()
        order = routed[:, expert].nonzero().flatten().tolist()
        order += (~routed[:, expert]).nonzero().flatten().tolist() if pad else []
        assert kept == sorted(order[: len(kept)]), (expert, kept, order)


def test_auxiliary_losses_equal_megatrons():
    logits = FIXTURE["x"] @ FIXTURE["weight"].t()
    scores = torch.softmax(logits, -1)
    counts = torch.zeros(EXPERTS).scatter_add(0, scores.topk(TOPK).indices.flatten(),
                                              torch.ones(TOKENS * TOPK))  # fmt: skip
    got = load_balancing_loss(scores, counts, TOKENS, TOPK, EXPERTS, 0.01)
    torch.testing.assert_close(got, FIXTURE["load_balancing_loss"])
    torch.testing.assert_close(z_loss(logits, 0.001), FIXTURE["z_loss"])


def test_sinkhorn_balancing_equals_megatrons():
    balanced = sinkhorn(FIXTURE["sinkhorn_logits"].float())
    torch.testing.assert_close(balanced, FIXTURE["sinkhorn_balanced"])
    # every expert's column carries about T / E of the tokens' unit rows
    torch.testing.assert_close(balanced.sum(0), torch.full((EXPERTS,), 1 / EXPERTS), atol=1e-3,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize("case", list(FIXTURE["sinkhorn"]), ids=str)
def test_sinkhorn_routing_equals_megatrons(case):
    """S-BASE routing of logits that favour expert 0: in training the balanced logits
    choose (no expert takes most tokens), in evaluation the weights; the weights are the
    sigmoid of the logits at top-1, their softmax at top-2."""
    topk, training = case
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=topk,
        moe_router_load_balancing_type="sinkhorn",
    )  # fmt: skip
    module = TopKRouter(config, ModelGroups.single().tp).train(training)
    with torch.no_grad():
        probs, routing_map = module._topk(FIXTURE["sinkhorn_logits"])
    want = FIXTURE["sinkhorn"][case]
    assert torch.equal(routing_map, want["routing_map"])
    torch.testing.assert_close(probs, want["probs"].float())
    if training:  # balanced: plain top-k would give expert 0 most of the tokens
        plain = FIXTURE["sinkhorn_logits"].topk(topk).indices
        assert routing_map.sum(0).max() < torch.bincount(plain.flatten()).max()


# (top-1 over a softmax of the one chosen logit needs pre-softmax: the pair is refused)
QUANTILE_CASES = [(case, score, pre) for case in FIXTURE["quantile"]
                  for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False))
                  if not (case[0] == 1 and score == "softmax" and not pre)]  # fmt: skip


@pytest.mark.parametrize("case,score,pre", QUANTILE_CASES, ids=str)
def test_quantile_balancing_equals_megatrons(case, score, pre):
    """In training the router takes Megatron's experts for its bias and adds Megatron's
    column quantile to the step's; the weights of those experts are Megatron's."""
    topk, _ = case
    want = FIXTURE["quantile"][case]
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=topk, moe_router_score_function=score,
        moe_router_pre_softmax=pre, moe_router_load_balancing_type="quantile_balancing",
    )  # fmt: skip
    module = TopKRouter(config, ModelGroups.single().tp)
    with torch.no_grad():
        module.weight.copy_(FIXTURE["weight"])
        module.qb_beta.copy_(want["beta"])
        probs, routing_map = module(FIXTURE["x"].unsqueeze(1))
    assert module.qb_beta_count == 0  # no gradient: evaluation, nothing counted
    module.train()
    logits = FIXTURE["x"] @ FIXTURE["weight"].t()
    chosen = module._quantile_choice(logits, counting=True)
    assert torch.equal(chosen, want["indices"])
    torch.testing.assert_close(module.qb_beta_accum, want["quantile"], rtol=0, atol=0)
    wanted = want["routing"][(score, pre)]
    assert torch.equal(routing_map, wanted["routing_map"])
    torch.testing.assert_close(probs, wanted["probs"])


def test_quantile_bias_update_is_megatrons_rule():
    """After a step: the mean of the micro-batches' quantiles (averaged over the
    data-parallel ranks), blended with the bias by the EMA, centred."""
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_router_quantile_balancing_ema=0.25,
        moe_router_load_balancing_type="quantile_balancing",
    )  # fmt: skip
    module = TopKRouter(config, ModelGroups.single().tp)
    first, second = torch.randn(2, EXPERTS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        module.qb_beta.copy_(first)
        module.qb_beta_accum.copy_(first + second)
        module.qb_beta_count.fill_(2)
    update_quantile_biases([module], ModelGroups.single().tp)
    blended = 0.25 * first + 0.75 * (first + second) / 2
    torch.testing.assert_close(module.qb_beta, blended - blended.mean())
    assert module.qb_beta_count == 0 and not module.qb_beta_accum.any()
