"""Context-parallel attention equals causal attention over the whole sequence on one rank:
outputs and the gradients of q, k and v, for every comm type, with GQA, at cp = 1, 2
and 4, and hierarchically (a2a+p2p) at 2 x 2, 4 x 1, 1 x 4 and 2 x 1; with attention
dropout over the ring and the all-gather, a one-rank softmax under the same masks; and the
pieces it is made of (the load-balanced layout, the block plan, the log-sum-exp merge) on
their own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mp_layers.context_parallel import (
    CP_COMM_TYPES,
    attention_blocks,
    block_math,
    local_chunks,
    local_positions,
    shard_sequence,
)
from mp_layers.context_parallel.block_math import block_backward, block_forward, merge_into
from mp_state.testing import RankFailure, run_on_ranks

S, B, NQ, NG, D = 32, 2, 8, 4, 8


def test_load_balanced_chunks():
    assert [local_chunks(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [local_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    assert shard_sequence(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard_sequence(x, 1, 0) is x
    with pytest.raises(ValueError, match="sequence length 8 is not divisible by 2 x "):
        shard_sequence(x, 3, 0)


def test_block_plan_skips_what_the_causal_mask_hides():
    # Own chunks (the first step): the diagonals, and the late chunk over the early one.
    assert [tuple(b) for b in attention_blocks((1, 6), (1, 6))] == [
        (0, 0, "causal"), (1, 0, "full"), (1, 1, "causal"),
    ]  # fmt: skip
    # From an earlier rank: both query chunks see its early chunk only.
    assert [tuple(b) for b in attention_blocks((1, 6), (0, 7))] == [(0, 0, "full"), (1, 0, "full")]
    # From a later rank: only the late query chunk, over both.
    assert [tuple(b) for b in attention_blocks((1, 6), (3, 4))] == [(1, 0, "full"), (1, 1, "full")]
    # Over all ranks of cp = 4, the blocks computed are the causal square's, no more.
    cp = 4
    for rank in range(cp):
        q = local_chunks(cp, rank)
        blocks = [b for src in range(cp) for b in attention_blocks(q, local_chunks(cp, src))]
        full = sum(b.kind == "full" for b in blocks)
        assert full == sum(q)  # chunk a sees a earlier chunks in full
        assert sum(b.kind == "causal" for b in blocks) == 2


@pytest.fixture(params=["flash", "matmul"])
def kernel(request, monkeypatch):
    """Each block kernel in turn (flash is the CPU's; matmul the one elsewhere)."""
    monkeypatch.setattr(block_math, "_flash", lambda q: request.param == "flash")
    return request.param


def test_merged_blocks_equal_one_softmax(kernel):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, 16).double(), torch.randn(3, 16, 16), torch.randn(3, 16, 16)
    k, v = k.double(), v.double()
    scale = 0.3
    ref_out, ref_lse = block_forward(q, k, v, False, scale)
    out = torch.zeros(ref_out.shape, dtype=torch.float32)
    lse = torch.full(ref_lse.shape, -torch.inf)
    for keys in (slice(8, 16), slice(0, 8)):
        merge_into(out, lse, *block_forward(q, k[:, keys], v[:, keys], False, scale))
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_block_backward_equals_autograd(kernel, causal):
    torch.manual_seed(1)
    q = torch.randn(3, 2, 8, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 8, 16, dtype=torch.float64, requires_grad=True)
    scale = 0.25
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
    scores = (q.reshape(3, 16, 16) @ k.transpose(1, 2)).view(3, 2, 8, 8) * scale
    probs = (scores.masked_fill(mask, -torch.inf) if causal else scores).softmax(-1)
    out = (probs.view(3, 16, 8) @ v).view(3, 2, 8, 16)
    dout = torch.randn_like(out)
    out.backward(dout)
    block_out, lse = block_forward(q.detach(), k.detach(), v.detach(), causal, scale)
    torch.testing.assert_close(block_out.double(), out.detach(), rtol=1e-5, atol=1e-5)
    grads = block_backward(q.detach(), k.detach(), v.detach(), dout, out.detach(), lse, causal,
                           scale)  # fmt: skip
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def causal_attention(q, k, v):
    """[s, b, n, d] -> [s, b, n * d] on one rank (torch's SDPA)."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True
    )
    return out.permute(2, 0, 1, 3).flatten(2)


def _reference(q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _inputs():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(S, B, NQ, D, generator=generator)
    k, v = (torch.randn(S, B, NG, D, generator=generator) for _ in range(2))
    grad = torch.randn(S, B, NQ * D, generator=generator)
    return q, k, v, grad


def compare_on_ranks(comm_type: str, levels: list[int] | None = None) -> float:
    import mp_state
    from mp_layers.context_parallel import context_parallel_attention
    from mp_layers.context_parallel.hierarchical import hierarchical_attention
    from mp_layers.context_parallel.ulysses import ulysses_attention

    torch.set_num_threads(1)
    cp = torch.distributed.get_world_size()
    state = mp_state.initialize(mp_state.ParallelConfig(
        context_parallel_size=cp, hierarchical_context_parallel_sizes=levels))  # fmt: skip
    group = state.cp
    q, k, v, grad = _inputs()
    expected = _reference(q, k, v, grad)
    local = [shard_sequence(t, cp, group.rank, dim=0) for t in (q, k, v)]
    local = [t.clone().requires_grad_() for t in local]
    if comm_type == "a2a":
        out = ulysses_attention(*local, group, causal_attention)
    elif comm_type == "a2a+p2p":
        out = hierarchical_attention(*local, group, (state.cp_a2a, state.cp_p2p),
                                     1 / math.sqrt(D), causal_attention)  # fmt: skip
    else:
        scale = 1 / math.sqrt(D)
        out = context_parallel_attention(*local, group, scale=scale, comm_type=comm_type)
    out.backward(shard_sequence(grad, cp, group.rank, dim=0))
    worst = 0.0
    for got, want in zip((out, *(t.grad for t in local)), expected, strict=True):
        want = shard_sequence(want, cp, group.rank, dim=0)
        assert got.shape == want.shape
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


@pytest.mark.multirank
@pytest.mark.parametrize("comm_type", [*CP_COMM_TYPES, "a2a"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_parallel_attention_equals_one_rank(cp, comm_type):
    errors = run_on_ranks(compare_on_ranks, cp, comm_type, timeout=120)
    assert max(errors) < 1e-5, errors


@pytest.mark.multirank
@pytest.mark.parametrize("levels", [[2, 2], [4, 1], [1, 4], [2, 1]])
def test_hierarchical_context_parallel_attention_equals_one_rank(levels):
    """cp_comm_type a2a+p2p: an all-to-all over the inner groups (consecutive CP ranks),
    the ring over the outer ones, at 2 x 2 and with either level of one rank."""
    cp = levels[0] * levels[1]
    errors = run_on_ranks(compare_on_ranks, cp, "a2a+p2p", levels, timeout=120)
    assert max(errors) < 1e-5, errors


def time_ring_waits() -> tuple[dict, dict, bool]:
    import mp_state
    from mp_layers.context_parallel import context_parallel_attention, timed_ring_waits

    torch.set_num_threads(1)
    cp = torch.distributed.get_world_size()
    state = mp_state.initialize(mp_state.ParallelConfig(context_parallel_size=cp))
    q, k, v, grad = _inputs()
    local = [shard_sequence(t, cp, state.cp.rank, dim=0).requires_grad_() for t in (q, k, v)]
    with timed_ring_waits() as timed:
        out = context_parallel_attention(*local, state.cp, scale=1.0, comm_type="p2p")
        out.backward(shard_sequence(grad, cp, state.cp.rank, dim=0))
        with pytest.raises(RuntimeError, match="already timing"), timed_ring_waits():
            pass
    # Outside, nothing is counted any more.
    context_parallel_attention(*local, state.cp, scale=1.0, comm_type="p2p").sum().backward()
    return timed.waits, timed.seconds, all(s >= 0 for s in timed.seconds.values())


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_timed_ring_waits_count_every_exchange(cp):
    for waits, seconds, nonnegative in run_on_ranks(time_ring_waits, cp, timeout=120):
        # k/v: cp - 1 exchanges in forward and again in backward; each backward step
        # passes its gradient accumulator on, the last one home.
        assert waits == {"kv": 2 * (cp - 1), "grad": cp}, waits
        assert set(seconds) == {"kv", "grad"} and nonnegative, seconds


def refuse_on_ranks() -> None:
    import mp_state
    from mp_layers.context_parallel.ulysses import ulysses_attention

    state = mp_state.initialize(mp_state.ParallelConfig(context_parallel_size=3))
    q = torch.zeros(6, 1, 4, 2)
    k = torch.zeros(6, 1, 2, 2)
    ulysses_attention(q, k, k, state.cp, causal_attention)


@pytest.mark.multirank
def test_all_to_all_needs_heads_divisible_by_cp():
    message = r"num_query_groups=2 \(with num_attention_heads=4\) is not divisible"
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(refuse_on_ranks, 3, timeout=60)


DROPOUT, SEED = 0.25, 12345


def dropped_reference(q, k, v, grad, cp: int):
    """Causal attention on one rank in fp64 with the dropout masks the ranks draw: the
    sequence's 2 x cp chunks, each pair's masks from dropout_keep (a softmax written out,
    so that the masks multiply its probabilities)."""
    from mp_layers.context_parallel import dropout_keep

    s, b, nq, d = q.shape
    ng, c = k.shape[2], s // (2 * cp)
    keep = torch.ones(b * ng, nq // ng, s, s, dtype=torch.float64)
    for a in range(2 * cp):
        for kv in range(a + 1):
            block = dropout_keep(SEED, a, kv, (b * ng, nq // ng, c, c), DROPOUT, q.device)
            keep[:, :, a * c : (a + 1) * c, kv * c : (kv + 1) * c] = block
    keep = keep.view(b, ng, nq // ng, s, s).reshape(b, nq, s, s)  # [b, nq, s, s]
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    kh, vh = (t.repeat_interleave(nq // ng, dim=1) for t in (kh, vh))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
    out = (probs * keep) @ vh  # [b, nq, s, d]
    out = out.permute(2, 0, 1, 3).flatten(2)
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


def dropout_on_ranks(comm_type: str) -> float:
    import mp_state
    from mp_layers.context_parallel import context_parallel_attention

    torch.set_num_threads(1)
    cp = torch.distributed.get_world_size()
    state = mp_state.initialize(mp_state.ParallelConfig(context_parallel_size=cp))
    q, k, v, grad = _inputs()
    expected = dropped_reference(q, k, v, grad, cp)
    local = [shard_sequence(t, cp, state.cp.rank, dim=0) for t in (q, k, v)]
    local = [t.clone().requires_grad_() for t in local]
    out = context_parallel_attention(
        *local,
        state.cp,
        scale=1 / math.sqrt(D),
        comm_type=comm_type,
        dropout=DROPOUT,
        dropout_seed=SEED,
    )
    out.backward(shard_sequence(grad, cp, state.cp.rank, dim=0))
    worst = 0.0
    for got, want in zip((out, *(t.grad for t in local)), expected, strict=True):
        want = shard_sequence(want, cp, state.cp.rank, dim=0).float()
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


@pytest.mark.multirank
@pytest.mark.parametrize(("cp", "comm_type"), [(1, "p2p"), (2, "p2p"), (2, "all_gather")])
def test_attention_dropout_equals_one_rank_with_the_same_masks(cp, comm_type):
    """Attention dropout over the ring and the all-gather: outputs and the gradients of q,
    k and v equal a one-rank softmax whose probabilities are multiplied by the masks each
    pair of chunks draws (dropout_keep), which are drawn again, the same, in backward."""
    errors = run_on_ranks(dropout_on_ranks, cp, comm_type, timeout=120)
    assert max(errors) < 1e-5, errors


def test_dropout_masks_drop_about_p_and_depend_on_the_seed_and_pair():
    from mp_layers.context_parallel import dropout_keep

    shape = (8, 4, 32, 32)
    keep = dropout_keep(SEED, 3, 1, shape, DROPOUT, torch.device("cpu"))
    assert keep.unique().tolist() == [0.0, torch.tensor(1 / (1 - DROPOUT)).item()]
    assert abs((keep == 0).float().mean().item() - DROPOUT) < 0.02
    assert torch.equal(keep, dropout_keep(SEED, 3, 1, shape, DROPOUT, torch.device("cpu")))
    for other in ((SEED + 1, 3, 1), (SEED, 1, 3), (SEED, 3, 2)):
        assert not torch.equal(keep, dropout_keep(*other, shape, DROPOUT, torch.device("cpu")))
