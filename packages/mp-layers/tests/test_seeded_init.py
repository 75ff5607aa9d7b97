"""With an init seed, a model split into pipeline stages is the same model."""

import dataclasses

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


def test_the_last_stage_draws_its_copy_of_the_tied_embedding_as_the_first_stage():
    # Tied embeddings across stages, with an init seed: the last stage's output weight and
    # an MTP last stage's embedding are drawn from the embedding's seeded draw, bitwise the
    # first stage's, so no collective has to make them equal.
    whole = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=5)
    last = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, init_seed=5, pre_process=False,
                    layer_offset=2, num_layers=2)  # fmt: skip
    assert last.copy_drawn and last.output_layer.weight.shared_embedding
    assert torch.equal(last.output_layer.weight, whole.embedding.weight)
    mtp = dataclasses.replace(CONFIG, position_embedding_type="rope", mtp_num_layers=1)
    last_mtp = GPTModel(mtp, "local", 64, 16, groups=SINGLE, init_seed=5, pre_process=False,
                        layer_offset=2, num_layers=2)  # fmt: skip
    assert last_mtp.output_layer.weight is last_mtp.embedding.weight
    assert torch.equal(last_mtp.embedding.weight, whole.embedding.weight)
    # Without an init seed the copy starts at zero, for sync_tied_embeddings to fill.
    unseeded = GPTModel(CONFIG, "local", 64, 16, groups=SINGLE, pre_process=False,
                        layer_offset=2, num_layers=2)  # fmt: skip
    assert not unseeded.copy_drawn and not unseeded.output_layer.weight.any()


def test_without_an_init_seed_the_global_stream_decides():
    torch.manual_seed(1)
    a = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE))
    torch.manual_seed(1)
    b = pieces(GPTModel(CONFIG, "local", 64, 16, groups=SINGLE))
    assert all(torch.equal(a[k], b[k]) for k in a)
