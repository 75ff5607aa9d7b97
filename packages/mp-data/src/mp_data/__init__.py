"""mp-data: Megatron-compatible datasets for pretraining.

Today: the .bin/.idx indexed dataset (reader, builder, merge), byte-compatible
with Megatron-LM's MMIDIDX format.
"""

from mp_data.indexed_builder import IndexedDatasetBuilder, merge_datasets
from mp_data.indexed_dataset import IndexedDataset
from mp_data.indexed_format import DType, get_bin_path, get_idx_path

__all__ = [
    "DType",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "get_bin_path",
    "get_idx_path",
    "merge_datasets",
]
