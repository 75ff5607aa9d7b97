"""Generation draws only ids the tokenizer has: the rows padding the model's vocabulary
are never chosen, however large their logits."""

from __future__ import annotations

import torch

from mp_gpt.generate import generate


class PaddingFavoured(torch.nn.Module):
    """Logits [b, s, 8] whose largest value is in the padding row 7, then row 2."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, 8)
        logits[..., 7] = 10.0
        logits[..., 2] = 5.0
        return logits * self.scale


def test_padding_rows_are_never_drawn():
    model = PaddingFavoured()
    assert generate(model, [0], max_new_tokens=3, max_length=4)[1:] == [7, 7, 7]
    assert generate(model, [0], max_new_tokens=3, max_length=4, vocab_size=6)[1:] == [2, 2, 2]
    sampled = generate(model, [0], max_new_tokens=20, max_length=4, vocab_size=6,
                       temperature=1.0, seed=3)  # fmt: skip
    assert max(sampled) < 6
