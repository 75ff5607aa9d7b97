"""Core attention against the written-out formula, through each backend: outputs and
gradients; GQA; masks; dropout streams; the auto choice; attention over a KVCache."""

import math

import pytest
import torch

from mp_layers.transformer.blocked_attention import blocked_attention, saved_probability_bytes
from mp_layers.transformer.core_attention import (
    AUTO_BLOCKED_LIMIT_BYTES,
    CoreAttention,
)
from mp_layers.transformer.kv_cache import KVCache
from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker


def by_formula(q, k, v, mask=None):
    s, b, nq, d = q.shape
    k = k.repeat_interleave(nq // k.shape[2], dim=2)
    v = v.repeat_interleave(nq // v.shape[2], dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
    return out.reshape(s, b, nq * d)


def outputs_and_grads(fn, q, k, v, mask=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["flash", "local"])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_causal_attention_equals_the_formula(backend, groups):
    torch.manual_seed(0)
    q = torch.randn(7, 2, 4, 8)
    k, v = torch.randn(7, 2, groups, 8), torch.randn(7, 2, groups, 8)
    attention = CoreAttention(0.0, None, backend)
    expected = outputs_and_grads(by_formula, q, k, v)
    for got, want in zip(outputs_and_grads(attention, q, k, v), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["flash", "local"])
def test_an_explicit_mask_resets_documents(backend):
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 1, 2, 4), torch.randn(6, 1, 2, 4), torch.randn(6, 1, 2, 4)
    document = torch.tensor([0, 0, 0, 1, 1, 1])
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() & (document[:, None] == document[None])
    mask = (~allowed)[None, None]
    attention = CoreAttention(0.0, None, backend)
    torch.testing.assert_close(attention(q, k, v, mask), by_formula(q, k, v, mask))


def test_a_row_that_sees_no_key_gives_zero_in_both_backends():
    """A fully masked row: output 0 (torch's SDPA on a CPU gives 0) and finite gradients
    for every input; the other rows as the formula gives them."""
    torch.manual_seed(4)
    q, k, v = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)
    mask[1, 0, 3, :] = True  # sample 1, position 3 may see nothing
    formula = outputs_and_grads(by_formula, q, k, v, mask)[0]
    for backend in ("flash", "local"):
        out, *grads = outputs_and_grads(CoreAttention(0.0, None, backend), q, k, v, mask)
        assert not out.view(6, 2, 4, 8)[3, 1].any(), backend
        assert all(g.isfinite().all() for g in grads), backend
        live = torch.ones(6, 2, dtype=torch.bool)
        live[3, 1] = False
        torch.testing.assert_close(out[live], formula[live])


@pytest.mark.parametrize("explicit_mask", [False, True])
@pytest.mark.parametrize(("s", "block"), [(7, 3), (8, 4), (9, 9), (5, 16)])
def test_blocks_of_any_size_give_the_formula(s, block, explicit_mask):
    """Blocks that divide s, that leave a shorter last block, one block, and a block
    longer than s; outputs and gradients; GQA with 2 heads per group; a batch of 2
    with a different mask per sample."""
    torch.manual_seed(s * 10 + block)
    q, k, v = torch.randn(s, 2, 4, 8), torch.randn(s, 2, 2, 8), torch.randn(s, 2, 2, 8)
    mask = None
    if explicit_mask:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)
        mask[1, 0, s // 2 :, : s // 2] = True  # sample 1: a second document from s // 2

    def blocked(q, k, v, mask):
        return blocked_attention(q, k, v, mask, scale=8**-0.5, block=block)

    expected = outputs_and_grads(by_formula, q, k, v, mask)
    for got, want in zip(outputs_and_grads(blocked, q, k, v, mask), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("explicit_mask", "window", "sink", "dropout"),
    [(False, None, False, 0.0), (True, None, False, 0.0), (False, 2, True, 0.0),
     (True, 2, True, 0.3), (False, None, False, 0.3), (True, None, True, 0.0)],
)  # fmt: skip
def test_the_blocks_own_backward_passes_gradcheck(explicit_mask, window, sink, dropout):
    """blocked_attention's backward (written per block, not autograd's) against finite
    differences in float64: GQA, 3 blocks of 7 positions, with and without an explicit
    mask (a row that sees no key included), a window, sinks and dropout (the same masks
    each call: the tracker restarts from one state)."""
    torch.manual_seed(3)
    q = torch.randn(7, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(7, 2, 2, 5, dtype=torch.float64, requires_grad=True) for _ in "kv")
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if sink else None
    mask = None
    if explicit_mask:
        mask = torch.ones(7, 7, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)
        mask[1, 0, 4:, :4] = True
        mask[0, 0, 2, :] = True  # sample 0, position 2 sees nothing
    tracker = RNGStatesTracker("cpu")
    tracker.add(TENSOR_PARALLEL_RNG, 5)
    start = tracker.get_states()

    def attend(q, k, v, *sinks):
        tracker.set_states(start)
        return blocked_attention(q, k, v, mask, scale=0.4, block=3, window=window,
                                 sink=sinks[0] if sinks else None, dropout=dropout,
                                 rng_tracker=tracker)  # fmt: skip

    inputs = (q, k, v) + ((sinks,) if sink else ())
    assert torch.autograd.gradcheck(attend, inputs, fast_mode=True)


def test_bf16_blocks_are_as_close_to_fp32_as_sdpa():
    """In bf16 the blocked path's error against an fp32 reference is about SDPA's
    (both keep bf16 probabilities): within 1.5x of it for the output and each gradient."""
    torch.manual_seed(2)
    q, k, v = torch.randn(64, 2, 4, 16), torch.randn(64, 2, 2, 16), torch.randn(64, 2, 2, 16)
    reference = outputs_and_grads(by_formula, q, k, v)
    errors = {}
    for backend in ("flash", "local"):
        attention = CoreAttention(0.0, None, backend)
        low = outputs_and_grads(attention, *(t.bfloat16() for t in (q, k, v)))
        pairs = zip(low, reference, strict=True)
        errors[backend] = [(a.float() - b).abs().max().item() for a, b in pairs]
    for blocked, sdpa in zip(errors["local"], errors["flash"], strict=True):
        assert blocked <= 1.5 * sdpa, errors


def test_saved_probability_bytes_counts_the_blocks_at_and_below_the_diagonal():
    for s, block in [(512, 256), (7, 3), (5, 16), (1024, 256)]:
        elements = sum((hi - lo) * hi for lo in range(0, s, block) for hi in [min(lo + block, s)])
        assert saved_probability_bytes(s, 3, 4, 2, block=block) == 3 * 4 * elements * 2
    assert saved_probability_bytes(512, 4, 8, 2) == 4 * 8 * 512 * (512 + 256) // 2 * 2
    assert saved_probability_bytes(10, 1, 1, 4, causal=False) == 400


def test_auto_takes_blocked_matmuls_only_for_short_sequences_on_a_cpu():
    attention = CoreAttention(0.0, None, "auto")
    fp32, bf16 = AUTO_BLOCKED_LIMIT_BYTES[torch.float32], AUTO_BLOCKED_LIMIT_BYTES[torch.bfloat16]
    short = torch.empty(512, 4, 8, 64)
    assert saved_probability_bytes(512, 4, 8, 4) <= fp32
    assert attention.uses_blocked(short) and attention.uses_blocked(short.bfloat16())
    # 1 x 8 heads x 2048 x (2048 + 256) / 2 probabilities: 72 MiB in fp32, 36 in bf16.
    long = torch.empty(2048, 1, 8, 64)
    assert saved_probability_bytes(2048, 1, 8, 4) > fp32
    assert not attention.uses_blocked(long)
    assert saved_probability_bytes(2048, 1, 8, 2) <= bf16
    assert attention.uses_blocked(long.bfloat16())
    longer = torch.empty(4096, 1, 8, 64, dtype=torch.bfloat16)
    assert saved_probability_bytes(4096, 1, 8, 2) > bf16
    assert not attention.uses_blocked(longer)
    # An explicit mask keeps the whole square: 3 x 8 heads x 2048^2 in bf16 is 192 MiB,
    # against 108 MiB for the causal blocks.
    middle = torch.empty(2048, 3, 8, 64, dtype=torch.bfloat16)
    assert attention.uses_blocked(middle)
    assert not attention.uses_blocked(middle, explicit_mask=True)
    assert not attention.uses_blocked(short.double())  # no measured limit: SDPA
    assert not attention.uses_blocked(short.to("meta"))  # not a CPU: SDPA
    assert CoreAttention(0.0, None, "local").uses_blocked(long)
    assert not CoreAttention(0.0, None, "flash").uses_blocked(short)
    with pytest.raises(ValueError, match="attention_backend='sdpa' must be one of"):
        CoreAttention(0.0, None, "sdpa")


@pytest.mark.parametrize("backend", ["flash", "local"])
def test_dropout_draws_from_the_tensor_parallel_stream(backend):
    tracker = RNGStatesTracker("cpu")
    tracker.add(TENSOR_PARALLEL_RNG, 123)
    attention = CoreAttention(0.5, tracker, backend).train()
    q = torch.randn(5, 1, 2, 4)
    saved = tracker.get_states()
    torch.manual_seed(7)
    first = attention(q, q, q)
    tracker.set_states(saved)
    torch.manual_seed(99)  # the default stream does not matter
    again = attention(q, q, q)
    torch.testing.assert_close(first, again)
    assert not torch.equal(first, CoreAttention(0.0, None, backend)(q, q, q))  # it drops
    with pytest.raises(ValueError, match="needs an rng_tracker"):
        CoreAttention(0.1, None)


@pytest.mark.parametrize("groups", [4, 2])
def test_attention_over_a_kv_cache_equals_the_formula(groups):
    """The next positions (one, then two) over a left-padded cache's keys (read in blocks
    of KEY_BLOCK slots, the unfilled ones masked), GQA included, through CoreAttention as
    generation calls it."""
    torch.manual_seed(0)
    b, nq, d = 2, 4, 8
    cache = KVCache(torch.tensor([2, 0]), 12)
    attention = CoreAttention(0.0, None)
    for s in (5, 1, 2):  # the prompts, then one new position, then two
        q = torch.randn(s, b, nq, d)
        k, v = cache.update(0, torch.randn(s, b, groups, d), torch.randn(s, b, groups, d))
        mask = cache.attention_mask(s, "cpu")
        got = attention(q, k, v, mask)  # cached_attention once keys outnumber queries
        torch.testing.assert_close(got, by_formula(q, k, v, mask))
        cache.advance(s)
