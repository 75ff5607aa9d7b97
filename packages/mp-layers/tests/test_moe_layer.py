"""The MoE layer's parts in one process: routing rules, capacity, auxiliary losses, the
grouped matmul, and the whole layer against a token-by-token reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.moe import (
    MoELayer,
    TopKRouter,
    capacity_mask,
    expert_capacity,
    grouped_matmul,
    routers_of,
    take_metrics,
    update_expert_biases,
)

H, E = 16, 4
ALONE = ModelGroups.single()


def config(**settings) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, activation="swiglu",
                add_bias_linear=False, num_moe_experts=E, moe_ffn_hidden_size=8, ffn_hidden_size=32,
                hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    return TransformerConfig(**base | settings)


def routed(router: TopKRouter, x: torch.Tensor):
    probs, routing_map = router(x)
    return probs, routing_map, x.reshape(-1, H) @ router.weight.t()


def test_softmax_routing_renormalizes_the_top_k_like_mixtral():
    router = TopKRouter(config(), ALONE.tp)
    probs, routing_map, logits = routed(router, torch.randn(5, 2, H))
    full = torch.softmax(logits, -1)
    top, chosen = full.topk(2)
    want = torch.zeros_like(full).scatter(1, chosen, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, want)
    assert routing_map.sum(-1).eq(2).all() and torch.equal(routing_map, want > 0)


def test_pre_softmax_keeps_the_full_softmax_weights_and_scaling_multiplies():
    router = TopKRouter(config(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
                        ALONE.tp)  # fmt: skip
    probs, _, logits = routed(router, torch.randn(5, 2, H))
    full = torch.softmax(logits, -1)
    top, chosen = full.topk(2)
    torch.testing.assert_close(probs, torch.zeros_like(full).scatter(1, chosen, 2.5 * top))


def test_sigmoid_scores_are_normalized_and_the_expert_bias_only_chooses():
    router = TopKRouter(config(moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True), ALONE.tp)  # fmt: skip
    x = torch.randn(6, 1, H)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    probs, routing_map, logits = routed(router, x)
    assert routing_map[:, 2:].all() and not routing_map[:, :2].any()
    scores = torch.sigmoid(logits[:, 2:])
    torch.testing.assert_close(probs[:, 2:], scores / scores.sum(-1, keepdim=True))


def test_capacity_keeps_megatrons_tokens():
    # 6 tokens, top-1 over 2 experts, factor 1: capacity ceil(6 * 1 / 2 * 1) = 3.
    probs = torch.tensor([[0.9, 0], [0.8, 0], [0.95, 0], [0.7, 0], [0, 0.6], [0.99, 0]])
    routing_map = probs > 0
    assert expert_capacity(6, 1, 2, 1.0) == 3
    by_probs = capacity_mask(probs, routing_map, 1, 1.0, "probs") & routing_map
    assert by_probs[:, 0].nonzero().flatten().tolist() == [0, 2, 5]
    by_position = capacity_mask(probs, routing_map, 1, 1.0, "position") & routing_map
    assert by_position[:, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert by_probs[4, 1] and by_position[4, 1]
    padded = capacity_mask(probs, routing_map, 1, 1.0, "position")
    assert padded.sum(0).tolist() == [3, 3] and padded[:, 1].nonzero().flatten().tolist() == [
        0, 1, 4
    ]  # fmt: skip
    # A capacity above the token count drops nothing.
    assert capacity_mask(probs, routing_map, 1, 3.0, "probs").all()


def test_router_drops_over_capacity_and_pads():
    x = torch.randn(8, 1, H)
    dropping = TopKRouter(config(moe_expert_capacity_factor=0.5), ALONE.tp)
    probs, routing_map = dropping(x)
    capacity = math.ceil(8 * 2 / E * 0.5)
    assert routing_map.sum(0).le(capacity).all() and routing_map.sum() < 16
    assert torch.equal(probs > 0, routing_map)
    padding = TopKRouter(config(moe_expert_capacity_factor=0.5,
                                moe_pad_expert_input_to_capacity=True), ALONE.tp)  # fmt: skip
    padding.load_state_dict(dropping.state_dict())
    _, padded_map = padding(x)
    assert padded_map.sum(0).eq(capacity).all()


def test_auxiliary_losses_have_their_formulas_and_reach_the_router_weight():
    router = TopKRouter(config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), ALONE.tp)
    x = torch.randn(6, 2, H)
    probs, routing_map, logits = routed(router, x)
    metrics = take_metrics([router])
    scores = torch.softmax(logits, -1)
    counts = routing_map.sum(0).float()
    tokens = 12
    balance = E / (2 * tokens**2) * (scores.sum(0) * counts).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(metrics["load_balancing_loss"], balance.detach())
    torch.testing.assert_close(metrics["z_loss"], z.detach())
    assert take_metrics([router]) == {}
    # Backward of nothing but the router's output: the losses' gradients alone, scaled.
    router.aux_loss_scale.set(3.0)
    (probs * 0).sum().backward()
    want = torch.autograd.grad(3.0 * (0.1 * balance + 0.01 * z), router.weight)[0]
    torch.testing.assert_close(router.weight.grad, want)


def test_sequence_aux_loss_averages_the_per_sequence_losses():
    settings = dict(moe_aux_loss_coeff=1.0, moe_router_load_balancing_type="seq_aux_loss")
    router = TopKRouter(config(**settings), ALONE.tp)
    x = torch.randn(5, 3, H)
    _, _, logits = routed(router, x)
    got = take_metrics([router])["seq_load_balancing_loss"]
    per_sequence = []
    for j in range(3):
        seq_logits = logits.view(5, 3, E)[:, j]
        scores = torch.softmax(seq_logits, -1)
        counts = torch.zeros(E).scatter_add(0, scores.topk(2).indices.flatten(), torch.ones(10))
        per_sequence.append(E / (2 * 25) * (scores.sum(0) * counts).sum())
    torch.testing.assert_close(got, torch.stack(per_sequence).mean().detach())


def test_expert_bias_moves_towards_the_underloaded_experts():
    router = TopKRouter(config(moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True,
                               moe_router_bias_update_rate=0.5), ALONE.tp)  # fmt: skip
    router.local_tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    update_expert_biases(routers_of([router]), ALONE.tp)
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert router.local_tokens_per_expert.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 6])  # 6: rows the kernel cannot take
@pytest.mark.parametrize("counts", [[4, 0, 6], [5, 5]])  # equal counts: one batched matmul
def test_grouped_matmul_equals_one_matmul_per_group(dtype, width, counts):
    x = torch.randn(10, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), width, 8, dtype=dtype, requires_grad=True)
    outs = []
    for grouped in (True, False):
        out = grouped_matmul(x, w.transpose(1, 2), counts, grouped)
        grads = torch.autograd.grad(out.sum(), (x, w))
        outs.append((out, *grads))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want)
    start = counts[0] + (counts[1] if len(counts) > 2 else 0)
    torch.testing.assert_close(outs[0][0][start:], x[start:] @ w[-1].t())


@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_matmul_of_experts_without_tokens(grouped):
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(2, 16, 8, requires_grad=True)
    out = grouped_matmul(x, w.transpose(1, 2), [0, 0], grouped)
    assert out.shape == (0, 16)
    (grad,) = torch.autograd.grad(out.sum(), w)
    assert grad.eq(0).all()


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_layer_equals_a_token_by_token_reference(grouped):
    cfg = config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True,
                 moe_grouped_gemm=grouped)  # fmt: skip
    layer = MoELayer(cfg, ALONE)
    x = torch.randn(5, 2, H)
    out, bias = layer(x)
    assert bias is None
    probs, _ = layer.router(x)
    tokens = x.reshape(-1, H)
    gate, up = layer.experts.linear_fc1.weight.chunk(2, dim=1)
    want = []
    for t, token in enumerate(tokens):
        total = torch.zeros(H)
        for e in probs[t].nonzero().flatten().tolist():
            inner = F.silu(gate[e] @ token) * (up[e] @ token)
            total += probs[t, e] * (layer.experts.linear_fc2.weight[e] @ inner)
        want.append(total)
    shared = layer.shared_experts
    s_gate, s_up = shared.linear_fc1.weight.chunk(2)
    shared_out = shared.linear_fc2.weight @ (F.silu(s_gate @ tokens.t()) * (s_up @ tokens.t()))
    want = torch.stack(want) + torch.sigmoid(tokens @ shared.gate_weight.t()) * shared_out.t()
    torch.testing.assert_close(out.reshape(-1, H), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [False, True])
def test_probs_on_input_scale_the_experts_input_as_llama_4(grouped):
    """Top-1 sigmoid routing with the weight applied to the expert's input (Llama 4):
    each token's output is its shared expert's plus expert(p x) of its one expert; the
    router's weight still gets its gradient through p."""
    llama4 = dict(
        moe_router_topk=1,
        moe_router_score_function="sigmoid",
        moe_shared_expert_intermediate_size=12,
        init_method_std=0.3,
    )
    cfg = config(**llama4, moe_apply_probs_on_input=True, moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    layer = MoELayer(cfg, ALONE)
    x = torch.randn(5, 2, H)
    out, _ = layer(x)
    probs, routing_map, logits = routed(layer.router, x)
    tokens = x.reshape(-1, H)
    gate, up = layer.experts.linear_fc1.weight.chunk(2, dim=1)
    shared = layer.shared_experts
    s_gate, s_up = shared.linear_fc1.weight.chunk(2)
    want = []
    for t, token in enumerate(tokens):
        (e,) = routing_map[t].nonzero().flatten().tolist()
        assert probs[t, e] == torch.sigmoid(logits[t, e])  # one expert: not renormalized
        scaled = torch.sigmoid(logits[t, e]) * token
        inner = F.silu(gate[e] @ scaled) * (up[e] @ scaled)
        shared_out = shared.linear_fc2.weight @ (F.silu(s_gate @ token) * (s_up @ token))
        want.append(layer.experts.linear_fc2.weight[e] @ inner + shared_out)
    torch.testing.assert_close(out.reshape(-1, H), torch.stack(want), rtol=1e-5, atol=1e-6)
    # Not the output scaled: the expert is not linear, so the two differ.
    plain = MoELayer(config(**llama4), ALONE)
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x)[0], out, rtol=0.05, atol=0)
    out.square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(moe_router_topk=5), "moe_router_topk=5 exceeds num_moe_experts=4"),
        (
            dict(moe_apply_probs_on_input=True),
            "moe_apply_probs_on_input=True needs moe_router_topk=1 \\(got 2\\)",
        ),
        (
            dict(add_bias_linear=True, moe_shared_expert_intermediate_size=8),
            "add_bias_linear=True with moe_shared_expert_intermediate_size=8",
        ),
        (dict(moe_layer_freq=[1, 0]), r"moe_layer_freq=\[1, 0\] must be an integer or 1"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
        (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function='sigmoid'"),
        (dict(num_moe_experts=None, moe_aux_loss_coeff=0.1), "moe_aux_loss_coeff=0.1 needs"),
    ],
)
def test_moe_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        config(**settings)


@pytest.mark.parametrize(
    ("sizes", "settings", "message"),
    [
        ((1, 1, 3, 1), {}, "expert_model_parallel_size=3 does not divide num_moe_experts=4"),
        ((1, 1, 1, 3), {}, "expert_tensor_parallel_size=3 does not divide moe_ffn"),
        (
            (1, 1, 2, 1),
            dict(num_moe_experts=None, moe_ffn_hidden_size=None),
            "expert_model_parallel_size=2 needs",
        ),
    ],
)
def test_expert_layouts_are_checked(sizes, settings, message):
    with pytest.raises(ValueError, match=message):
        config(**settings).check_parallel(*sizes)


def test_router_dtype_computes_the_scores_in_that_precision():
    # Logits 256.05 and 256.95 for experts 0 and 1: equal in bf16 (both 256), so the top 2
    # weigh 0.5 each; in fp64 they weigh softmax([256.05, 256.95]).
    x = torch.ones(3, 1, H, dtype=torch.bfloat16)
    rows = torch.full((E, H), -1.0)
    rows[0], rows[1] = 256.05 / H, 256.95 / H
    weights = {}
    for dtype in (None, "fp64"):
        router = TopKRouter(config(moe_router_dtype=dtype), ALONE.tp)
        with torch.no_grad():
            router.weight.copy_(rows)
        probs, routing_map = router(x)
        assert probs.dtype == torch.bfloat16 and routing_map[:, :2].all()
        weights[dtype] = probs[:, :2].float()
    torch.testing.assert_close(weights[None], torch.full((3, 2), 0.5))
    want = torch.softmax(torch.tensor([256.05, 256.95], dtype=torch.float64), -1)
    torch.testing.assert_close(
        weights["fp64"], want.float().to(torch.bfloat16).float().expand(3, 2)
    )


def test_forced_load_balancing_routes_by_random_logits_from_the_expert_stream():
    """moe_router_force_load_balancing: the logits are normal draws of the tracker's
    expert-parallel stream, whatever the weights (a router that sends every token to
    expert 0 spreads them evenly), the same draws again from the same state; the
    gradient reaches the router's weight through the draws."""
    from mp_state import EXPERT_PARALLEL_RNG, RNGStatesTracker

    x = torch.randn(256, 1, H, generator=torch.Generator().manual_seed(0))
    routes = []
    for seed in (7, 7, 8):
        tracker = RNGStatesTracker("cpu")
        tracker.add(EXPERT_PARALLEL_RNG, seed)
        settings = dict(moe_router_force_load_balancing=True, moe_router_topk=1,
                        moe_router_score_function="sigmoid")  # fmt: skip
        router = TopKRouter(config(**settings), ALONE.tp, rng_tracker=tracker)
        with torch.no_grad():
            router.weight.zero_()
            router.weight[0] = 10.0  # every token's logit for expert 0 is the largest
        before = torch.get_rng_state()
        probs, routing_map = router(x)
        assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
        routes.append(routing_map)
    assert torch.equal(routes[0], routes[1]) and not torch.equal(routes[0], routes[2])
    per_expert = routes[0].sum(0)
    assert per_expert.sum() == 256 and per_expert.min() > 40, per_expert  # ~64 each
    probs.sum().backward()  # sigmoid(draw): the draws' gradient reaches the weight
    assert router.weight.grad.abs().sum() > 0


def test_forced_bias_tilts_the_random_routing_the_same_way_on_every_rank():
    """moe_router_force_biased S: the random logits of force_load_balancing plus a bias per
    expert from N(0, |S|), drawn from the data-parallel stream (seeded alike on every
    rank, so every rank favours the same experts): anew each forward for S > 0, once for
    S < 0."""
    from mp_state import DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG, RNGStatesTracker

    x = torch.randn(512, 1, H, generator=torch.Generator().manual_seed(0))

    def router_of(std, expert_seed):
        tracker = RNGStatesTracker("cpu")
        tracker.add(EXPERT_PARALLEL_RNG, expert_seed)  # differs between expert shards
        tracker.add(DATA_PARALLEL_RNG, 5)  # the same on every rank
        settings = dict(moe_router_force_biased=std, moe_router_topk=1,
                        moe_router_score_function="sigmoid")  # fmt: skip
        return TopKRouter(config(**settings), ALONE.tp, rng_tracker=tracker)

    counts = {seed: router_of(3.0, seed)(x)[1].sum(0) for seed in (7, 8)}
    # A bias of std 3 over 4 experts: the favoured expert takes most tokens on both ranks.
    assert counts[7].argmax() == counts[8].argmax() and counts[7].max() > 256, counts
    assert not torch.equal(counts[7], counts[8])  # their own random logits
    drawn = router_of(3.0, 7)
    first = drawn(x)[1].sum(0)
    kept, elsewhere = router_of(-3.0, 7), router_of(-3.0, 8)
    assert torch.equal(kept(x)[1].sum(0), first)  # the same first draw
    elsewhere(x)
    assert torch.equal(kept._kept_bias, elsewhere._kept_bias)  # every rank's
    # S > 0 draws from the data-parallel stream at each forward, S < 0 at the first only.
    for router, draws in ((drawn, True), (kept, False)):
        state = router.rng_tracker.get_states()[DATA_PARALLEL_RNG].clone()
        router(x)
        moved = not torch.equal(router.rng_tracker.get_states()[DATA_PARALLEL_RNG], state)
        assert moved == draws
