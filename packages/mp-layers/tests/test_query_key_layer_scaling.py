"""apply_query_key_layer_scaling (Megatron-LM's guard for fp16 scores): the blocked
attention's scores come out of their matmul divided by the layer's number and go into an
fp32 softmax multiplied back. In fp32 it is the same attention, outputs and gradients; in
fp16 scores past the format's range (65,504) overflow to inf without it and stay finite
with it, matching fp32; a model's layers take their own numbers (1-based)."""

import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.transformer.blocked_attention import blocked_attention

S, B, NQ, NG, D = 12, 2, 4, 2, 16


def attend(q, k, v, divisor, block=4):
    return blocked_attention(q, k, v, scale=D**-0.5, block=block, score_divisor=divisor)


def test_in_fp32_the_scaled_scores_give_the_same_attention():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, NQ, D, generator=generator, requires_grad=True)
    k, v = (torch.randn(S, B, NG, D, generator=generator, requires_grad=True) for _ in range(2))
    grad = torch.randn(S, B, NQ * D, generator=generator)
    results = []
    for divisor in (None, 7):
        out = attend(q, k, v, divisor)
        out.backward(grad)
        results.append((out.detach(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_in_fp16_scores_past_its_range_stay_finite_and_match_fp32():
    generator = torch.Generator().manual_seed(1)
    # q k_j / sqrt(16) = 1200 (250 + 10 j): 3.0e5 and up, past fp16's 65,504 and within it
    # once divided by 8, each later key's score 1.2e4 above the one before (each query
    # attends to its own position: fp16's rounding of the scores does not change that)
    q = torch.full((S, B, NQ, D), 300.0).half()
    positions = torch.arange(S, dtype=torch.float32).view(S, 1, 1, 1)
    k = (250 + 10 * positions).expand(S, B, NG, D).half()
    v = torch.randn(S, B, NG, D, generator=generator).half()
    unscaled = attend(q, k, v, None)
    assert not torch.isfinite(unscaled).all()  # the overflow the flag guards against
    scaled = attend(q, k, v, 8)
    reference = attend(q.float(), k.float(), v.float(), None)
    assert torch.isfinite(scaled).all()
    torch.testing.assert_close(scaled.float(), reference, rtol=1e-2, atol=1e-2)


def test_each_layer_divides_by_its_own_number_and_the_model_is_the_same():
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                attention_dropout=0.0, attention_backend="local")  # fmt: skip
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    losses = []
    for scaling in (False, True):
        config = TransformerConfig(**base, apply_query_key_layer_scaling=scaling)
        model = GPTModel(config, "local", 64, 8, groups=ModelGroups.single(), init_seed=4)
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        assert [c.score_divisor for c in cores] == ([1, 2, 3] if scaling else [None] * 3)
        losses.append(model(ids, labels=ids).detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
