"""With an init seed, a model split into pipeline stages is the same model."""

import torch

from mp_layers import GPTModel, ModelGroups, TransformerConfig

SINGLE = ModelGroups.single()
CONFIG = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                           hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip


def pieces(model):
    return {k: p.data.clone() for k, p in model.sharded_state_dict().items() if p.replica_id == 0}


def test_stages_with_an_init_seed_hold_the_whole_models_weights():
    torch.manual_seed(123)
    whole = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=5))
    torch.manual_seed(456)  # the global stream no longer matters
    first = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=5, post_process=False,
                     num_layers=1)  # fmt: skip
    rest = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=5, pre_process=False,
                    layer_offset=1, num_layers=3)  # fmt: skip
    split = pieces(first) | pieces(rest)
    assert set(split) == set(whole)
    for key, tensor in whole.items():
        assert torch.equal(split[key], tensor), key
    other = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=6))
    assert not torch.equal(other["decoder.layers.2.mlp.linear_fc1.weight"],
                           whole["decoder.layers.2.mlp.linear_fc1.weight"])  # fmt: skip


def test_without_an_init_seed_the_global_stream_decides():
    torch.manual_seed(1)
    a = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE))
    torch.manual_seed(1)
    b = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE))
    assert all(torch.equal(a[k], b[k]) for k in a)
