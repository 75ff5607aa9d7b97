"""MegatronDataset: what every dataset BlendedMegatronDatasetBuilder builds holds.

As megatron-core's base class: the low-level dataset it reads, that dataset's
path, the elements of its split, the samples asked for, the split and the
config; and the part of a cache key every such dataset shares.
"""

from __future__ import annotations

import numpy as np
import torch

from mp_data.gpt_config import GPTDatasetConfig
from mp_data.split import Split

__all__ = ["MegatronDataset"]


class MegatronDataset(torch.utils.data.Dataset):
    """The builder's six arguments, kept under megatron-core's names."""

    def __init__(
        self,
        indexed_dataset,
        dataset_path: str | None,
        indexed_indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indexed_indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

    def split_description(self) -> dict:
        """The settings that shape any dataset's indices: its class, split, elements,
        sample count, seed and sequence length (part of the cache key)."""
        c = self.config
        return {
            "class": type(self).__name__,
            "num_samples": self.num_samples,
            "index_split": self.index_split.name,
            "split_elements": [int(self.indices[0]), int(self.indices[-1]), len(self.indices)]
            if len(self.indices)
            else [],
            "random_seed": c.random_seed,
            "sequence_length": c.sequence_length,
        }
