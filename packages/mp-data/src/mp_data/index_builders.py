"""The native index builders of GPT and blended datasets, with Megatron-LM's semantics.

Three functions, each the counterpart of one of megatron/core/datasets/helpers.cpp
(same arguments, same arrays), so that the same data, seed and settings give
the same samples; docs/formats/gpt-indices.md describes the algorithms and
mp_data.index_reference restates them in numpy. Names: L = sequence_length,
e = add_extra_token_to_sequence, E = num_epochs, T = tokens_per_epoch.

- build_sample_idx -> sample_index [n + 1, 2]: row r is (position in
  document_index, token offset) of the flattened token r * L. Its dtype is
  int32 when max(len(document_index), max(sizes)) < 2**31, else int64
  (`sample_index_dtype`, Megatron's rule). n = (E*T - e) // L when the last
  partial sample is dropped; when it is kept, n = ceil((E*T - e) / L) computed
  in float32, as Megatron does. Above 2**24 tokens that ceiling can exceed the
  exact one: the extra rows repeat the end-of-stream row (last position, the
  length of its sequence - e), as Megatron's helper returns when compiled with
  NDEBUG (with asserts it stops there), so n and therefore the shuffle index
  stay Megatron's. T must be the tokens of one epoch of document_index: a
  document index that runs out of tokens sooner than E*T promises is a
  ValueError (Megatron's helper fails an assert there).
- build_blending_indices fills dataset_index (int16) and dataset_sample_index
  (int64) in place: sample i comes from argmax_j (w_j * max(i, 1) - count_j),
  ties to the lowest j. No randomness.
- build_exhaustive_blending_indices does the same with w_j = sizes[j] / sum(sizes)
  until every sample of every dataset is used exactly once. Where the note is
  silent we follow Megatron's helper: the weights are computed once over all
  datasets and are not renormalized when a dataset is used up; a used-up
  dataset just stops being a candidate; ties go to the lowest j. One
  deliberate difference: a dataset of size 0 is used up from the start
  (Megatron's helper keeps it a candidate forever, and once the others are
  used up it writes past the end of its arrays).

The extension mp_data._native is compiled when mp-data is installed; importing
this module without it is an ImportError that says how to rebuild, never a
slow fallback.
"""

from __future__ import annotations

import importlib
import operator
from types import ModuleType

import numpy as np

__all__ = [
    "INT32_SAMPLE_INDEX_LIMIT",
    "MAX_BLENDED_DATASETS",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "build_sample_idx",
    "sample_index_dtype",
]

INT32_SAMPLE_INDEX_LIMIT = 2**31
"""The sample index is int32 while len(document_index) and every size are below this."""

MAX_BLENDED_DATASETS = 2**15
"""dataset_index is int16 (Megatron's dtype), so a blend has at most this many datasets."""

_INT32_MAX = 2**31 - 1


def _load_native() -> ModuleType:
    try:
        return importlib.import_module("mp_data._native")
    except ImportError as error:
        raise ImportError(
            f"mp_data._native, the compiled index builders of mp-data, cannot be imported "
            f"({error}). It is built from C++ when mp-data is installed, never at run time: "
            "reinstall it with `uv sync --reinstall-package mp-data` in the workspace, or "
            "`pip install --force-reinstall --no-binary mp-data mp-data` elsewhere (needs a "
            "C++17 compiler; CMake and pybind11 come from PyPI)."
        ) from error


_native = _load_native()


def sample_index_dtype(num_positions: int, max_sequence_length: int) -> np.dtype:
    """Megatron's dtype for a sample index over len(document_index) = num_positions.

    int32 when both num_positions and max_sequence_length are below 2**31
    (INT32_SAMPLE_INDEX_LIMIT), else int64.
    """
    if max(num_positions, max_sequence_length) < INT32_SAMPLE_INDEX_LIMIT:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


def build_sample_idx(
    sizes: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> np.ndarray:
    """Where each sample of a GPT dataset starts: [n + 1, 2] (position, offset).

    sizes: int32 token count of every sequence of the indexed dataset.
    document_index: int32 sequence ids, all epochs concatenated (the order
        samples are cut from).
    tokens_per_epoch: tokens of one epoch, sizes[document_index].sum() / num_epochs.
    drop_last_partial_sequence: False keeps a last, shorter sample (Megatron
        keeps it for validation when asked).
    add_extra_token_to_sequence: 1 (Megatron's default) gives each sample one
        extra token, its last label, so consecutive samples overlap by it.

    Row 0 is (0, 0) and sample i spans rows i to i + 1 (plus e tokens). The
    dtype is `sample_index_dtype(len(document_index), max(sizes))`.
    """
    _check_array("sizes", sizes, np.int32)
    _check_array("document_index", document_index, np.int32)
    if len(document_index) == 0:
        raise ValueError("document_index is empty: a sample index needs at least one sequence")
    sequence_length = _check_int("sequence_length", sequence_length, 1, _INT32_MAX)
    num_epochs = _check_int("num_epochs", num_epochs, 1, _INT32_MAX)
    tokens_per_epoch = _check_int("tokens_per_epoch", tokens_per_epoch, 1, 2**63 - 1)
    # Megatron's config holds it as a bool.
    extra = _check_int("add_extra_token_to_sequence", add_extra_token_to_sequence, 0, 1, True)
    if num_epochs * tokens_per_epoch >= 2**63:
        raise ValueError(
            f"num_epochs={num_epochs} * tokens_per_epoch={tokens_per_epoch} overflows int64"
        )
    longest = int(sizes.max()) if len(sizes) else 0
    if len(sizes) and int(sizes.min()) < 0:
        position = int(np.argmin(sizes))
        raise ValueError(f"sizes[{position}]={int(sizes[position])} is negative")

    dtype = sample_index_dtype(len(document_index), longest)
    build = _native.build_sample_idx_int32 if dtype == np.int32 else _native.build_sample_idx_int64
    return build(
        sizes,
        document_index,
        sequence_length,
        num_epochs,
        tokens_per_epoch,
        bool(drop_last_partial_sequence),
        extra,
    )


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool = False,
) -> None:
    """Fills, in place, which dataset serves each of `size` blended samples.

    dataset_index (int16, length size) gets the dataset of sample i and
    dataset_sample_index (int64, length size) the index of that sample within
    its dataset. weights (float64, one per dataset) are normalized by the
    caller, as Megatron's BlendedDataset does. verbose prints the achieved
    ratios as Megatron's helper does.
    """
    _check_outputs(dataset_index, dataset_sample_index)
    _check_array("weights", weights, np.float64)
    num_datasets = _check_int("num_datasets", num_datasets, 1, MAX_BLENDED_DATASETS)
    if len(weights) != num_datasets:
        raise ValueError(f"weights has {len(weights)} entries; num_datasets={num_datasets}")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError(f"weights={weights.tolist()} must be finite and >= 0")
    size = _check_int("size", size, 0, 2**63 - 1)
    _check_lengths(dataset_index, dataset_sample_index, size, f"size={size}")
    _native.build_blending_indices(
        dataset_index, dataset_sample_index, weights, num_datasets, size, bool(verbose)
    )


def build_exhaustive_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    sizes: np.ndarray,
    num_datasets: int,
) -> None:
    """Fills, in place, a blend that uses every sample of every dataset exactly once.

    sizes (int64, one per dataset) are the datasets' sample counts; both
    outputs must have sum(sizes) entries. Datasets are interleaved in
    proportion to their sizes (see the module docstring for the details).
    """
    _check_outputs(dataset_index, dataset_sample_index)
    _check_array("sizes", sizes, np.int64)
    num_datasets = _check_int("num_datasets", num_datasets, 1, MAX_BLENDED_DATASETS)
    if len(sizes) != num_datasets:
        raise ValueError(f"sizes has {len(sizes)} entries; num_datasets={num_datasets}")
    if np.any(sizes < 0):
        raise ValueError(f"sizes={sizes.tolist()} must all be >= 0")
    total = int(sizes.sum(dtype=np.int64))
    _check_lengths(dataset_index, dataset_sample_index, total, f"sum(sizes)={total}")
    _native.build_exhaustive_blending_indices(
        dataset_index, dataset_sample_index, sizes, num_datasets
    )


def _check_array(name: str, value: object, dtype: type) -> None:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of {np.dtype(dtype)}, got {type(value)}")
    if value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {value.shape}")


def _check_outputs(dataset_index: object, dataset_sample_index: object) -> None:
    _check_array("dataset_index", dataset_index, np.int16)
    _check_array("dataset_sample_index", dataset_sample_index, np.int64)
    for name, array in (("dataset_index", dataset_index),
                        ("dataset_sample_index", dataset_sample_index)):  # fmt: skip
        if not array.flags.writeable:
            raise ValueError(f"{name} is read-only; it is filled in place")


def _check_lengths(dataset_index, dataset_sample_index, size: int, what: str) -> None:
    if len(dataset_index) != size or len(dataset_sample_index) != size:
        raise ValueError(
            f"dataset_index has {len(dataset_index)} entries and dataset_sample_index "
            f"{len(dataset_sample_index)}; both must have {what}"
        )


def _check_int(name: str, value: object, low: int, high: int, allow_bool: bool = False) -> int:
    if isinstance(value, bool | np.bool_):
        if not allow_bool:
            raise TypeError(f"{name}={value!r} must be an integer, not a bool")
        number = int(value)
    else:
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{name}={value!r} must be an integer") from None
    if not low <= number <= high:
        raise ValueError(f"{name}={number} must be in [{low}, {high}]")
    return number
