"""Core attention against the written-out formula; GQA; masks; dropout streams."""

import math

import pytest
import torch

from mp_layers.transformer.core_attention import CoreAttention
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


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_causal_attention_equals_the_formula(groups):
    torch.manual_seed(0)
    q = torch.randn(7, 2, 4, 8)
    k, v = torch.randn(7, 2, groups, 8), torch.randn(7, 2, groups, 8)
    attention = CoreAttention(0.0, None)
    torch.testing.assert_close(attention(q, k, v), by_formula(q, k, v))


def test_an_explicit_mask_resets_documents():
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 1, 2, 4), torch.randn(6, 1, 2, 4), torch.randn(6, 1, 2, 4)
    document = torch.tensor([0, 0, 0, 1, 1, 1])
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() & (document[:, None] == document[None])
    mask = (~allowed)[None, None]
    torch.testing.assert_close(CoreAttention(0.0, None)(q, k, v, mask), by_formula(q, k, v, mask))


def test_dropout_draws_from_the_tensor_parallel_stream():
    tracker = RNGStatesTracker("cpu")
    tracker.add(TENSOR_PARALLEL_RNG, 123)
    attention = CoreAttention(0.5, tracker).train()
    q = torch.randn(5, 1, 2, 4)
    saved = tracker.get_states()
    torch.manual_seed(7)
    first = attention(q, q, q)
    tracker.set_states(saved)
    torch.manual_seed(99)  # the default stream does not matter
    again = attention(q, q, q)
    torch.testing.assert_close(first, again)
    with pytest.raises(ValueError, match="needs an rng_tracker"):
        CoreAttention(0.1, None)
