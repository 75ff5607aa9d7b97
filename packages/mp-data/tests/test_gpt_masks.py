"""The vectorized masks equal the per-token definition (Megatron's loop)."""

import itertools

import torch

from mp_data import ltor_masks_and_position_ids

EOD = 7


def by_loop(tokens, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's definition, one end-of-document token at a time."""
    s = len(tokens)
    attention = torch.tril(torch.ones(s, s))
    loss = torch.ones(s)
    if eod_mask_loss:
        loss[tokens == EOD] = 0
    positions = torch.arange(s)
    previous = 0
    for i in torch.nonzero(tokens == EOD).flatten().tolist():
        if reset_attention_mask:
            attention[i + 1 :, : i + 1] = 0
        if reset_position_ids:
            positions[i + 1 :] -= i + 1 - previous
            previous = i + 1
    return (attention < 0.5).unsqueeze(0), loss, positions


def test_masks_equal_the_loop_definition():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        tokens = torch.randint(0, 10, (int(torch.randint(1, 64, (1,), generator=generator)),),
                               generator=generator)  # fmt: skip
        if trial % 5 == 0:
            tokens[-1] = EOD  # an end-of-document token in the last place
        for flags in itertools.product([False, True], repeat=3):
            got = ltor_masks_and_position_ids(tokens, EOD, *flags, create_attention_mask=True)
            want = by_loop(tokens, *flags)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w), (tokens.tolist(), flags)


def test_without_an_attention_mask():
    mask, loss, positions = ltor_masks_and_position_ids(
        torch.tensor([1, EOD, 2, 3]), EOD, True, False, True, create_attention_mask=False
    )
    assert mask is None
    assert loss.tolist() == [1, 0, 1, 1]
    assert positions.tolist() == [0, 1, 0, 1]
