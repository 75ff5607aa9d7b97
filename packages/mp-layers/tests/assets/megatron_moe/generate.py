"""Writes routing.pt: megatron-core 0.19's routing of fixed logits, the reference of
test_moe_megatron_routing.py. Run with megatron-core 0.19.2 installed (it runs on a CPU;
nothing here needs CUDA):

    python generate.py            # -> routing.pt beside this file

Cases: the top-k choice and weights of every score function setting (with and without
group-limited routing; a case's "topk" overrides TOPK), expert capacity
with both drop policies (with and without padding to capacity), the load-balancing loss
and the z-loss; Sinkhorn routing (TopKRouter.sinkhorn_load_balancing, called on a stand-in
router holding what it reads) at top-1 and top-2 in training and in evaluation, over
logits that favour one expert, and moe_utils.sinkhorn's balancing of them; quantile
balancing (moe_utils.qb_dual_update: the experts and the column quantile, with a zero and
a drawn bias, top-1 and top-2; the weights of its experts by each score function). Inputs:
x [T, h] and the router weight [E, h] (logits = x w^T).
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

TOKENS, HIDDEN, EXPERTS, TOPK = 24, 16, 8, 2

ROUTING = {
    "softmax": dict(score_function="softmax"),
    "softmax-pre": dict(score_function="softmax", use_pre_softmax=True),
    "softmax-scaled": dict(score_function="softmax", scaling_factor=2.5),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-bias": dict(score_function="sigmoid"),  # expert_bias below
    # Group-limited: each group ranked by the sum of its top (topk // group_topk) scores.
    "softmax-groups": dict(score_function="softmax", num_groups=4, group_topk=1),
    "softmax-pre-groups": dict(
        score_function="softmax", use_pre_softmax=True, num_groups=2, group_topk=1
    ),
    "sigmoid-bias-groups": dict(
        score_function="sigmoid", num_groups=2, group_topk=1, scaling_factor=2.5
    ),
    # DeepSeek-V3's shape: groups ranked by their top 2 (topk 4 // group_topk 2).
    "sigmoid-bias-groups-top4": dict(score_function="sigmoid", num_groups=4, group_topk=2, topk=4),
}
CAPACITY = [
    (factor, policy, pad)
    for factor in (0.5, 1.0, 1.5)
    for policy in ("probs", "position")
    for pad in (False, True)
]


def main() -> None:
    generator = torch.Generator().manual_seed(2024)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    weight = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.5
    bias = torch.randn(EXPERTS, generator=generator) * 0.3
    logits = x @ weight.t()
    out = {"x": x, "weight": weight, "expert_bias": bias, "topk": TOPK, "routing": {},
           "capacity": {}}  # fmt: skip
    for name, settings in ROUTING.items():
        settings = dict(settings)
        topk = settings.pop("topk", TOPK)
        extra = {"expert_bias": bias} if name.startswith("sigmoid-bias") else {}
        probs, routing_map = moe_utils.topk_routing_with_score_function(
            logits, topk, **settings, **extra
        )
        out["routing"][name] = {"settings": settings, "probs": probs, "routing_map": routing_map,
                                "topk": topk}  # fmt: skip
    probs, routing_map = (
        out["routing"]["softmax"]["probs"],
        out["routing"]["softmax"]["routing_map"],
    )
    for factor, policy, pad in CAPACITY:
        kept_probs, kept_map = moe_utils.apply_router_token_dropping(
            probs, routing_map, TOPK, factor, drop_policy=policy, pad_to_capacity=pad
        )
        out["capacity"][(factor, policy, pad)] = {"probs": kept_probs, "routing_map": kept_map}
    scores_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, "softmax")
    out["load_balancing_loss"] = moe_utils.switch_load_balancing_loss_func(
        scores, scores_map.sum(0), TOKENS, TOPK, EXPERTS, 0.01
    )
    out["z_loss"] = moe_utils.z_loss_func(logits, 0.001)
    # Sinkhorn: logits that send most tokens to expert 0 when ranked plainly
    skewed = logits + torch.tensor([2.0] + [0.0] * (EXPERTS - 1))
    out["sinkhorn_logits"] = skewed
    out["sinkhorn_balanced"] = moe_utils.sinkhorn(skewed.float())
    out["sinkhorn"] = {}
    for topk in (1, 2):
        for training in (True, False):
            stand_in = types.SimpleNamespace(
                topk=topk, training=training,
                config=types.SimpleNamespace(moe_aux_loss_coeff=0.0),
            )  # fmt: skip
            probs, routing_map = TopKRouter.sinkhorn_load_balancing(stand_in, skewed)
            out["sinkhorn"][(topk, training)] = {"probs": probs, "routing_map": routing_map}
    out["quantile"] = {}
    drawn = torch.randn(EXPERTS, generator=generator) * 0.5
    for topk in (1, 2):
        for name, beta in (("zero", torch.zeros(EXPERTS)), ("drawn", drawn)):
            indices, quantile = moe_utils.qb_dual_update(logits.float(), topk, beta)
            case = {"beta": beta, "indices": indices, "quantile": quantile, "routing": {}}
            for score, pre in (("softmax", False), ("softmax", True), ("sigmoid", False)):
                probs, routing_map = moe_utils.topk_routing_with_score_function(
                    logits, topk, use_pre_softmax=pre, score_function=score,
                    precomputed_indices=indices,
                )  # fmt: skip
                case["routing"][(score, pre)] = {"probs": probs, "routing_map": routing_map}
            out["quantile"][(topk, name)] = case
    torch.save(out, Path(__file__).with_name("routing.pt"))


if __name__ == "__main__":
    main()
