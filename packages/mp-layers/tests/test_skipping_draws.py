"""skipping_draws(): a model built to have a checkpoint loaded over it draws none of its
weight matrices (a dense model leaves the default generator where it was; a MoE model
still draws the router's small bias), and, once the whole model's weights are loaded
into it, computes what the drawn model computes."""

import dataclasses

import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig, skipping_draws

SINGLE = ModelGroups.single()
CONFIG = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                           num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                           normalization="RMSNorm", activation="swiglu",
                           position_embedding_type="rope")  # fmt: skip
MOE = dataclasses.replace(CONFIG, num_moe_experts=4, moe_router_topk=2)


def test_no_weight_is_drawn_and_a_loaded_model_computes_as_the_drawn_one():
    for config in (CONFIG, MOE):
        torch.manual_seed(3)
        drawn = GPTModel(config, "local", 64, 16, groups=SINGLE).eval()
        state = torch.get_rng_state()
        with skipping_draws():
            built = GPTModel(config, "local", 64, 16, groups=SINGLE).eval()
        if config is CONFIG:
            assert torch.equal(torch.get_rng_state(), state), "the generator moved"
        assert not torch.equal(built.embedding.weight, drawn.embedding.weight)
        built.load_state_dict(drawn.state_dict())
        ids = torch.randint(0, 64, (2, 16))
        with torch.no_grad():
            assert torch.equal(built(ids), drawn(ids))


def test_outside_the_context_weights_are_drawn_again():
    with skipping_draws():
        pass
    torch.manual_seed(3)
    a = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE)
    torch.manual_seed(3)
    b = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE)
    assert torch.equal(a.decoder.layers[0].mlp.linear_fc1.weight,
                       b.decoder.layers[0].mlp.linear_fc1.weight)  # fmt: skip
    assert a.decoder.layers[0].mlp.linear_fc1.weight.std() > 0.01
