"""MockGPTDataset: GPT samples from generated data, for runs without files.

The generated corpus is Megatron's: 100,000 sequences (numpy default_rng(0))
of 1 to 4095 tokens, sequence i being 1, 2, ... (mod the vocabulary) closed
by the end-of-document token. Everything above it (splits, epochs, shuffles,
masks) is the real GPTDataset.
"""

from __future__ import annotations

import numpy as np

from mp_data.gpt_config import GPTDatasetConfig
from mp_data.gpt_dataset import GPTDataset
from mp_data.split import Split

__all__ = ["MockGPTDataset", "MockGPTLowLevelDataset"]


class MockGPTLowLevelDataset:
    """An IndexedDataset look-alike whose sequences are computed, not read."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096
    path_prefix = None

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            1, self.max_sequence_length, size=self.size, dtype=np.int32
        )

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        body = (np.arange(offset, offset + length, dtype=np.int64) + 1) % self.vocab_size
        if length and offset + length == size:
            body[-1] = self.eod
        return body

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset; `config.mock` must be set."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset | None,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a config with mock=True")
        if dataset is None:
            dataset = self.build_low_level_dataset(None, config)
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None, config: GPTDatasetConfig):
        return MockGPTLowLevelDataset(config.tokenizer.vocab_size, config.tokenizer.eod)
