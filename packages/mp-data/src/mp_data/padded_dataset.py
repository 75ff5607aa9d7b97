"""PaddedToBatches: a dataset read whole in global batches, its last one filled with
samples that count no loss (full validation: every sample once, none twice)."""

from __future__ import annotations

import math

import torch

__all__ = ["PaddedToBatches"]


class PaddedToBatches(torch.utils.data.Dataset):
    """`dataset`'s samples, then as many as fill the last of `batch`-sample batches: copies
    of sample 0 whose loss_mask is zero (a loss averaged over the mask's tokens is the
    real samples' alone)."""

    def __init__(self, dataset, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        if len(dataset) < 1:
            raise ValueError("the dataset to pad has no sample")
        self.dataset, self.real = dataset, len(dataset)
        self.length = math.ceil(self.real / batch) * batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of {self.length}")
        if index < self.real:
            return self.dataset[index]
        item = dict(self.dataset[0])
        item["loss_mask"] = torch.zeros_like(item["loss_mask"])
        return item
