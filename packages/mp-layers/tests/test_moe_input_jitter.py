"""moe_input_jitter_eps (Megatron's --moe-input-jitter-eps): in training the router routes
its input times uniform noise in [1 - eps, 1 + eps] from the default generator, and the
gradient flows through the product; in evaluation it routes the input as it is; the
field's range is checked."""

import pytest
import torch

from mp_layers import ModelGroups, TransformerConfig
from mp_layers.moe import TopKRouter

H, E = 16, 8


def router(**fields) -> TopKRouter:
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2,
                               add_bias_linear=False, num_moe_experts=E, moe_router_topk=2,
                               moe_router_dtype="fp64", **fields)  # fmt: skip
    torch.manual_seed(0)
    return TopKRouter(config, ModelGroups.single().tp)


def test_training_routes_the_jittered_input_and_evaluation_the_input():
    jittered = router(moe_input_jitter_eps=0.1)
    plain = router()
    x = torch.randn(12, 2, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(5)
    probs, routing = jittered.train()(x)
    torch.manual_seed(5)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    expected, expected_map = plain.train()(x * noise)
    torch.testing.assert_close(probs, expected)
    assert torch.equal(routing, expected_map)
    assert not torch.allclose(probs, plain(x)[0])  # the noise changed the scores
    probs.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(jittered.eval()(x)[0], plain.eval()(x)[0])


@pytest.mark.parametrize(("fields", "message"), [
    ({"moe_input_jitter_eps": 1.5}, r"moe_input_jitter_eps=1.5 must be in \(0, 1\)"),
    ({"moe_input_jitter_eps": 0.1, "num_moe_experts": None}, "needs num_moe_experts"),
])  # fmt: skip
def test_the_range_and_a_dense_model_are_refused(fields, message):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**base | fields)
