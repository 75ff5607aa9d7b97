"""PaddedToBatches: the dataset's samples, then copies of sample 0 without loss up to a
multiple of the batch; bad sizes refused."""

import pytest
import torch

from mp_data import PaddedToBatches


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"tokens": torch.full((4,), i), "loss_mask": torch.ones(4)}


def test_the_last_batch_is_filled_with_samples_without_loss():
    padded = PaddedToBatches(Samples(), 3)
    assert len(padded) == 6
    assert [int(padded[i]["tokens"][0]) for i in range(6)] == [0, 1, 2, 3, 4, 0]
    assert [float(padded[i]["loss_mask"].sum()) for i in range(6)] == [4, 4, 4, 4, 4, 0]
    assert len(PaddedToBatches(Samples(), 5)) == 5
    with pytest.raises(IndexError):
        padded[6]
    with pytest.raises(ValueError, match="batch=0 must be >= 1"):
        PaddedToBatches(Samples(), 0)
