"""BlendedMegatronDatasetBuilder: the train, valid and test datasets of a run.

From a config's blend (prefixes, optional weights) and split, or its
blend_per_split, and the samples wanted per split, it builds one dataset per
split (None where a split is empty or absent), as megatron-core does:

- one prefix, no weights: that dataset's split, directly;
- weights and a sample count: each dataset is asked for
  ceil(ceil(count * w) * (1 + mid_level_dataset_surplus)) samples, and a
  BlendedDataset of sum(ceil(count * w)) samples mixes them;
- no weights: each dataset gives one epoch of its split, and the blend
  weighs them by their sizes (all of them when the count is None);
- weights without a count: an error.

Under torch.distributed every rank calls build(): rank 0 builds each dataset
(and its cached indices) first, a barrier, then the other ranks build the
same datasets, which finds the cache. `is_built_on_rank` lets ranks that need
no data (middle pipeline stages) skip the work but not the barriers.

With num_dataset_builder_threads above 1 (Megatron's --num-dataset-builder-threads),
the datasets of a blend's prefixes are built by that many threads: rank 0 builds all
of them, a barrier, then the other ranks, each in the blend's order (the datasets are
the same as one thread's). Megatron-LM doubles rank 0's threads on a node with two or
more GPUs; mp keeps the number given (mp-data does not ask CUDA about devices).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch.distributed as dist

from mp_data.blended_dataset import BlendedDataset
from mp_data.gpt_config import GPTDatasetConfig
from mp_data.split import Split, split_indices

__all__ = ["BlendedMegatronDatasetBuilder", "train_valid_test_num_samples"]


def train_valid_test_num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> list[int]:
    """Megatron's per-split sample counts: training, plus every evaluation and a final one."""
    evaluations = (train_iters // eval_interval + 1) * eval_iters if eval_interval else 0
    return [
        train_iters * global_batch_size,
        evaluations * global_batch_size,
        eval_iters * global_batch_size,
    ]


class BlendedMegatronDatasetBuilder:
    """Builds `cls` (GPTDataset, MockGPTDataset) datasets per split, blended as configured."""

    def __init__(
        self,
        cls: type,
        sizes: list[int | None],
        is_built_on_rank: Callable[[], bool],
        config: GPTDatasetConfig,
    ) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes has {len(sizes)} entries; give one per train, valid, test")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config

    def build(self) -> list:
        """[train, valid, test]: a dataset, or None, per split (collective when distributed)."""
        c = self.config
        if c.mock:
            return self._splits(None, c.split_matrix, self.sizes)
        if c.blend is not None:
            return self._blend(*c.blend, c.split_matrix, list(Split))
        result: list = [None] * len(Split)
        for split in Split:
            blend = c.blend_per_split[split.value]
            if blend is not None:
                whole = [None] * len(Split)
                whole[split.value] = (0.0, 1.0)
                result[split.value] = self._blend(*blend, whole, [split])[split.value]
        return result

    def _blend(self, prefixes, weights, matrix, splits: list[Split]) -> list:
        sizes = [self.sizes[s.value] if s in splits else None for s in Split]
        if len(prefixes) == 1:
            return self._splits(prefixes[0], matrix, sizes)
        if weights is not None:
            w = np.array(weights, dtype=np.float64)
            weights = (w / w.sum()).tolist()
            for s in splits:
                if matrix[s.value] is not None and sizes[s.value] is None:
                    raise ValueError(
                        f"blend weights {weights} need a sample count for the {s.name} split"
                    )
            surplus = self.config.mid_level_dataset_surplus
            targets = [[_ceil(n, w) for n in sizes] for w in weights]
            asked = [[_ceil(_ceil(n, w), 1 + surplus) for n in sizes] for w in weights]
        else:
            targets = asked = [[None] * len(Split) for _ in prefixes]
        per_dataset = self._per_dataset(prefixes, matrix, asked)
        result: list = [None] * len(Split)
        for s in splits:
            i = s.value
            if matrix[i] is None:
                continue
            parts = [d[i] for d in per_dataset]
            if weights is not None:
                blend_weights, size = weights, sum(t[i] for t in targets)
            else:
                blend_weights = [len(p) for p in parts] if None not in parts else [0] * len(parts)
                size = None if sizes[i] is None else min(sizes[i], sum(blend_weights))
            result[i] = self._build(BlendedDataset, parts, blend_weights, size, self.config)
        return result

    def _per_dataset(self, prefixes: list[str], matrix, asked: list[list[int | None]]) -> list:
        """`_splits` of each prefix, in order: one by one, each on rank 0 first; or, with
        several threads, all of them on rank 0 first, then all on the other ranks."""
        threads = min(self.config.num_dataset_builder_threads, len(prefixes))
        if threads == 1:
            return [self._splits(p, matrix, a) for p, a in zip(prefixes, asked, strict=True)]

        def build_all() -> list:
            with ThreadPoolExecutor(threads, thread_name_prefix="mp-data-builder") as pool:
                built = pool.map(lambda p, a: self._splits(p, matrix, a, build=_call),
                                 prefixes, asked)  # fmt: skip
                return list(built)

        built = self._build(build_all)
        return built if built is not None else [[None] * len(Split) for _ in prefixes]

    def _splits(self, prefix: str | None, matrix, sizes: list[int | None],
                build: Callable | None = None) -> list:  # fmt: skip
        """The datasets of one prefix: one per split of the matrix, None for the others.
        `build(cls, *args)` makes each (by default `_build`: on rank 0 first)."""
        build = build or self._build
        # Rank 0 first: a low-level dataset may build a cache the others then read (SFT).
        low_level = build(self.cls.build_low_level_dataset, prefix, self.config)
        ids = [None] * len(Split)
        if low_level is not None:
            ids = split_indices(matrix, self.cls.numel_low_level_dataset(low_level))
        result: list = []
        for split in Split:
            if matrix[split.value] is None:
                result.append(None)
                continue
            args = (low_level, prefix, ids[split.value], sizes[split.value], split, self.config)
            result.append(build(self.cls, *args))
        return result

    def _build(self, cls: Callable, *args):
        """cls(*args) where is_built_on_rank: on rank 0 first, then, after a barrier, on the
        other ranks; None elsewhere. When rank 0 fails (a damaged file), it still reaches
        the barrier before raising, so the other ranks go on and find the fault themselves,
        each naming it, instead of losing rank 0 at the barrier."""
        if not dist.is_initialized():
            return cls(*args)
        rank, dataset = dist.get_rank(), None
        if rank == 0 and self.is_built_on_rank():
            try:
                dataset = cls(*args)
            except Exception:
                dist.barrier()
                raise
        dist.barrier()
        if rank != 0 and self.is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _call(cls: Callable, *args):
    """cls(*args), here and now (a builder thread's: its rank's turn came already)."""
    return cls(*args)


def _ceil(n: int | None, factor: float) -> int | None:
    """ceil(n * factor), None for a split without a sample count."""
    return None if n is None else math.ceil(n * factor)
