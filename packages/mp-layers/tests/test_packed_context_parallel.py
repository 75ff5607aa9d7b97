"""Packed documents under context parallelism, through GPTModel: at CP2 (p2p,
all_gather, a2a) and CP4 (p2p, a2a) each rank's per-token losses are the one-rank losses
of its tokens and the gradients summed over the group are the one-rank gradients (fp32,
1e-5), for samples whose documents all divide into 2 x cp chunks (split by document,
Megatron's packed-sequence layout) and for documents cut anywhere (split by sample,
blocks masked to documents), those also with gpt-oss's sinks and sliding windows."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_layers import GPTModel, ModelGroups, PackedSeqParams, TransformerConfig
from mp_layers.transformer.multi_token_prediction import roll_left
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

VOCAB, SEQ = 128, 64
# Per sample, its documents' lengths: every one a multiple of 8 (2 x cp at CP4) ...
ALIGNED = [[8, 24, 16, 16], [32, 8, 24]]
# ... or not.
CUT_ANYWHERE = [[5, 30, 29], [64]]
LAYOUTS = [(1, "p2p"), (2, "p2p"), (2, "all_gather"), (2, "a2a"), (4, "p2p"), (4, "a2a")]


def document_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([
        torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths
    ])  # fmt: skip


# gpt-oss's attention: learnable sinks, a window of 5 keys back on every other layer
SINKS_AND_WINDOWS = dict(softmax_type="learnable", window_size=(5, 0), window_attn_skip_freq=2)


def losses_and_grads(lengths, attention: dict) -> list:
    results = []
    ids = document_ids(lengths)
    for cp, comm_type in LAYOUTS:
        state = mp_state.initialize(ParallelConfig(context_parallel_size=cp))
        tracker = mp_state.set_random_seeds(1234, state)
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
            kv_channels=8, position_embedding_type="rope", normalization="RMSNorm",
            activation="swiglu", ffn_hidden_size=96, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0, cp_comm_type=comm_type,
            init_method_std=0.05, **attention,
        )  # fmt: skip
        model = GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.of(state),
                         rng_tracker=tracker, init_seed=7)  # fmt: skip
        generator = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, VOCAB, ids.shape, generator=generator)
        labels = torch.randint(0, VOCAB, ids.shape, generator=generator)
        packed = PackedSeqParams.from_document_ids(ids, cp, state.cp.rank)
        loss = model(packed.shard(tokens), attention_mask=packed, labels=packed.shard(labels))
        (loss.sum() / ids.numel()).backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=state.cp.group)
            grads[name] = grad
        results.append((packed.split, packed.shard(torch.arange(SEQ).expand_as(ids)),
                        loss.detach(), grads))  # fmt: skip
        mp_state.destroy()
    return results


@pytest.mark.parametrize(
    ("lengths", "split", "attention"),
    [(ALIGNED, "document", {}), (CUT_ANYWHERE, "sample", {}),
     (ALIGNED, "document", SINKS_AND_WINDOWS), (CUT_ANYWHERE, "sample", SINKS_AND_WINDOWS)],
    ids=["by-document", "by-sample", "by-document-sinks-windows", "by-sample-sinks-windows"],
)  # fmt: skip
def test_packed_documents_under_context_parallelism_match_one_rank(lengths, split, attention):
    per_rank = run_on_ranks(losses_and_grads, 4, lengths, attention, timeout=240)
    _, _, reference_loss, reference_grads = per_rank[0][0]
    for i, (cp, comm_type) in enumerate(LAYOUTS[1:], start=1):
        where = f"CP{cp} {comm_type}"
        for rank in range(4):
            got_split, positions, loss, grads = per_rank[rank][i]
            assert got_split == split, where
            want = reference_loss.gather(1, positions)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=where)
            for name, want_grad in reference_grads.items():
                torch.testing.assert_close(
                    grads[name], want_grad, rtol=1e-5, atol=1e-6,
                    msg=lambda m, n=name, w=where: f"{n} at {w}: {m}",
                )  # fmt: skip
    assert any(g.abs().sum() > 0 for g in reference_grads.values())


def test_the_document_split_gives_each_rank_its_chunks_of_every_document():
    ids = document_ids([[4, 8, 4]])
    ranks = [PackedSeqParams.from_document_ids(ids, 2, r) for r in range(2)]
    positions = torch.arange(16)[None]
    # Rank r: chunk r of each document, then chunk 3 - r of each (chunks of 1, 2, 1).
    assert ranks[0].shard(positions).tolist() == [[0, 4, 5, 12, 3, 10, 11, 15]]
    assert ranks[1].shard(positions).tolist() == [[1, 6, 7, 13, 2, 8, 9, 14]]
    assert ranks[0].positions.tolist() == [[0, 0, 1, 0, 3, 6, 7, 3]]
    assert ranks[0].chunk_segments == [[(0, 1), (1, 3), (3, 4)]]
    assert ranks[1].whole().segments == [[(0, 4), (4, 12), (12, 16)]]
    cut = PackedSeqParams.from_document_ids(document_ids([[3, 13]]), 2, 0)
    assert cut.split == "sample" and cut.shard(positions).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


def roll_on_ranks() -> list:
    cp = dist.get_world_size()
    state = mp_state.initialize(ParallelConfig(context_parallel_size=cp))
    packed = PackedSeqParams.from_document_ids(document_ids(ALIGNED), cp, state.cp.rank)
    values = torch.arange(1, 2 * SEQ + 1).view(2, SEQ)
    got = roll_left(packed.shard(values), state.cp, packed.order)
    rolled = torch.cat([values[:, 1:], torch.zeros(2, 1, dtype=values.dtype)], dim=1)
    return [got, packed.shard(rolled)]


@pytest.mark.parametrize("cp", [2, 4])
def test_roll_left_follows_the_document_split(cp):
    for got, want in run_on_ranks(roll_on_ranks, cp, timeout=120):
        assert torch.equal(got, want)
