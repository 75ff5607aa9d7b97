"""Mixed precision: forward under autocast, backward inside or outside it."""

import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state import RankGroup

ONE_RANK = RankGroup("tp", (0,), 0, None)


def grads(backward_inside_autocast: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        ffn_hidden_size=64, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(config, "local", 64, 16, groups=ModelGroups.single())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).mean()
        if backward_inside_autocast:
            loss.backward()
    if not backward_inside_autocast:
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_backward_outside_autocast_works_and_matches_inside():
    outside, inside = grads(False), grads(True)
    for name, grad in inside.items():
        assert outside[name].dtype == torch.float32
        assert torch.isfinite(outside[name]).all(), name
        torch.testing.assert_close(outside[name], grad, rtol=0, atol=0, msg=name)
