"""BlendedDataset: samples drawn from several datasets in given proportions.

Two arrays decide the blend: dataset_index[i] (int16) says which dataset
sample i comes from and dataset_sample_index[i] (int64) which of its
samples. They are built natively with Megatron's rule, with no randomness:

- with weights and a size: sample i goes to the dataset furthest behind its
  share, argmax_j(w_j * max(i, 1) - count_j), ties to the lowest j; the
  counts then match the weights to within one sample;
- without weights (exhaustive): every sample of every dataset exactly once,
  interleaved in proportion to the samples each has left.

Datasets are built with a small surplus (mid_level_dataset_surplus) so that
the blend never asks one for more samples than it has; if it would, the
error says by how much and which setting to raise.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from mp_data.gpt_config import GPTDatasetConfig
from mp_data.index_builders import build_blending_indices, build_exhaustive_blending_indices
from mp_data.index_cache import IndexCache

__all__ = ["BlendedDataset"]

_MAX_DATASETS = 32767  # dataset ids are int16
_INDEX_ARRAYS = ("dataset_index", "dataset_sample_index")


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples from `datasets` in proportion to `weights`.

    size=None blends exhaustively: `weights` are then the integer sample
    counts of the datasets and the blend has their sum.
    """

    def __init__(
        self,
        datasets: list,
        weights: list[float] | list[int],
        size: int | None,
        config: GPTDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets")
        if not 0 < len(datasets) < _MAX_DATASETS:
            limit = _MAX_DATASETS - 1
            raise ValueError(f"a blend holds 1 to {limit} datasets, got {len(datasets)}")
        splits = {d.index_split for d in datasets}
        if len(splits) != 1:
            raise ValueError(f"blended datasets must come from one split, got {sorted(splits)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be > 0, got {list(weights)}")
        if size is None and any(int(w) != w for w in weights):
            raise ValueError(f"an exhaustive blend (size=None) needs sample counts, got {weights}")
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.size = size
        self.config = config
        if size is None:
            self.weights = [int(w) for w in weights]
        else:
            w = np.array(weights, dtype=np.float64)
            self.weights = (w / w.sum()).tolist()
        arrays = self._load_or_build()
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def description(self) -> dict:
        return {
            "class": type(self).__name__,
            "datasets": [d.description() for d in self.datasets],
            "split": self.split.name,
            "weights": self.weights,
            "size": self.size,
        }

    def _load_or_build(self) -> dict[str, np.ndarray]:
        folder = self.config.path_to_cache
        if folder is None:
            return self._build()
        name = f"{type(self).__name__}-{self.split.name}"
        cache = IndexCache(folder, name, self.description(), _INDEX_ARRAYS)
        may_build = not dist.is_initialized() or dist.get_rank() == 0
        return cache.load_or_build(self._build, may_build)

    def _build(self) -> dict[str, np.ndarray]:
        size = self.size if self.size is not None else sum(self.weights)
        dataset_index = np.zeros(size, dtype=np.int16)
        dataset_sample_index = np.zeros(size, dtype=np.int64)
        n = len(self.datasets)
        if self.size is not None:
            weights = np.array(self.weights, dtype=np.float64)
            build_blending_indices(dataset_index, dataset_sample_index, weights, n, size, False)
        else:
            counts = np.array(self.weights, dtype=np.int64)
            build_exhaustive_blending_indices(dataset_index, dataset_sample_index, counts, n)
        ids, counts = np.unique(dataset_index, return_counts=True)
        for j, count in zip(ids.tolist(), counts.tolist(), strict=True):
            have = len(self.datasets[j])
            if count > have:
                raise ValueError(
                    f"the {self.split.name} blend asks dataset {j} "
                    f"({self.datasets[j].dataset_path}) for {count} samples but it has {have}; "
                    f"raise mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus})"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        j = int(self.dataset_index[idx])
        return {"dataset_id": j, **self.datasets[j][int(self.dataset_sample_index[idx])]}
