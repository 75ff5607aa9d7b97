"""Drawing tokens: only ids the tokenizer has (the rows padding the model's vocabulary are
never chosen, however large their logits), greedy ties to the first, top-k and top-p keep
what they say, a seed gives the same draws, and a batch stops each sequence at its own
end-of-document token."""

from __future__ import annotations

import pytest
import torch

from mp_gpt.generation import Sampling, generate_batch, sample


class Fixed(torch.nn.Module):
    """Logits [b, 1, 8]: row 7 (padding) largest, then row 2; a sequence whose last token
    is 4 gets the end-of-document token 5 next."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        kv_cache.advance(ids.shape[1])
        logits = torch.zeros(ids.shape[0], 1, 8)
        logits[..., 7] = 10.0
        logits[..., 2] = 5.0
        logits[ids[:, -1] == 4, 0, 5] = 20.0
        return logits * self.scale


def run(prompts, vocab_size=None, **sampling):
    return generate_batch(Fixed(), prompts, max_new_tokens=3, eod=5, vocab_size=vocab_size,
                          sampling=[Sampling(**sampling)] * len(prompts))  # fmt: skip


def test_padding_rows_are_never_drawn():
    assert run([[0]])[0].tokens == [7, 7, 7]
    assert run([[0]], vocab_size=6)[0].tokens == [2, 2, 2]
    drawn = run([[0]] * 8, vocab_size=6, temperature=1.0, seed=3)
    assert max(t for c in drawn for t in c.tokens) < 6


def test_each_sequence_stops_at_its_own_end_of_document():
    stopped, going = run([[1, 4], [0]], vocab_size=6)
    assert stopped.tokens == [5] and stopped.finish_reason == "eod"
    assert going.tokens == [2, 2, 2] and going.finish_reason == "length"
    # The log-probabilities are the model's (log-softmax of the logits over the vocabulary).
    want = torch.log_softmax(torch.tensor([0, 0, 5.0, 0, 0, 0]), -1)[2]
    assert going.logprobs == pytest.approx([float(want)] * 3)


def test_top_k_top_p_and_seeds():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0])
    draws = {sample(logits, Sampling(1.0, top_k=2, seed=0), torch.Generator().manual_seed(s))
             for s in range(200)}  # fmt: skip
    assert draws == {0, 1}
    # top_p 0.5: token 0 alone holds 0.64 of the probability.
    assert {sample(logits, Sampling(1.0, top_p=0.5), torch.Generator().manual_seed(s))
            for s in range(50)} == {0}  # fmt: skip
    first = [sample(logits, Sampling(1.0), torch.Generator().manual_seed(7)) for _ in range(5)]
    assert len(set(first)) == 1
    assert sample(torch.tensor([1.0, 3.0, 3.0]), Sampling(), torch.Generator()) == 1
    with pytest.raises(ValueError, match="top_p=0"):
        Sampling(top_p=0)
