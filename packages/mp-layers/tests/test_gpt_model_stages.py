"""GPTModel split into two pipeline stages, embeddings tied across them, equals one stage."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import check_tiling
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_state import ParallelConfig

pytestmark = pytest.mark.multirank

VOCAB, SEQ = 64, 12
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0)  # fmt: skip


def two_stages():
    state = mp_state.initialize(ParallelConfig(pipeline_model_parallel_size=2))
    config = TransformerConfig(**CONFIG)
    first = state.is_pipeline_first_stage()
    torch.manual_seed(0)
    whole = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())
    torch.manual_seed(state.pp.rank + 10)  # stage weights start different from `whole`
    stage = GPTModel(
        config, "local", VOCAB, SEQ, groups=ModelGroups.of(state), pre_process=first,
        post_process=not first, layer_offset=0 if first else 1, num_layers=1,
    )  # fmt: skip
    # Load `whole`'s weights by logical name, except the last stage's tied copy ...
    logical = {k: p.data for k, p in whole.sharded_state_dict().items()}
    pieces = stage.sharded_state_dict()
    with torch.no_grad():
        for key, piece in pieces.items():
            if piece.replica_id == 0:
                piece.data.copy_(logical[key][piece.global_slices])
    # ... which the embedding group's sync must supply.
    stage.sync_tied_embeddings(state.embedding)
    tied = stage.embedding.weight if first else stage.output_layer.weight
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    result = {"tied": tied.detach().clone(), "pieces": pieces}
    with torch.no_grad():
        if first:
            hidden = stage(ids)
            dist.send(hidden.contiguous(), dst=state.pp.ranks[1])
        else:
            hidden = torch.empty(SEQ, 2, 32)
            dist.recv(hidden, src=state.pp.ranks[0])
            result["loss"] = stage(None, labels=labels, decoder_input=hidden)
            result["want"] = whole(ids, labels=labels)
    mp_state.destroy()
    return result


def test_two_stages_with_tied_embeddings_equal_one_stage():
    from mp_state.testing import run_on_ranks

    first, last = run_on_ranks(two_stages, 2, timeout=120)
    torch.testing.assert_close(last["tied"], first["tied"], rtol=0, atol=0)
    torch.testing.assert_close(last["loss"], last["want"], rtol=1e-6, atol=1e-6)
    # Saved once: the last stage's copy is a replica of the first stage's embedding.
    shapes = check_tiling([*first["pieces"].values(), *last["pieces"].values()])
    assert shapes["embedding.word_embeddings.weight"] == (VOCAB, 32)
    assert "output_layer.weight" not in shapes
