"""The index builders restated in numpy and plain Python.

The tests' oracle and the benchmark's baseline: same arguments and same
results as mp_data.index_builders (see its docstring and
docs/formats/gpt-indices.md), derived independently of the native walk:

- The sample index is computed in closed form. Lay the sequences of
  document_index end to end and let ends[k] be the tokens up to and including
  position k. Sample r - 1 starts at flattened token (r - 1) * L and needs
  L + e tokens, so the walk that finds row r stops at the first position whose
  end reaches q = r * L + e, and row r = (that position, r * L - its start).
  A q beyond the last end is the end of the stream: (last position,
  length of the last sequence - e), Megatron's row there.
- The blending functions are the greedy rule written as a loop over samples.

Row values only: build_sample_idx returns int64 whatever the size; the dtype
rule is index_builders.sample_index_dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "build_sample_idx",
    "count_samples",
]


def count_samples(
    num_epochs: int,
    tokens_per_epoch: int,
    sequence_length: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> int:
    """n, the samples of a sample index: rows n + 1.

    Keeping the last partial sample takes Megatron's ceiling in float32:
    float32(tokens) / float32(L), each rounded to nearest, then ceil.
    """
    tokens = num_epochs * tokens_per_epoch - add_extra_token_to_sequence
    if drop_last_partial_sequence:
        return tokens // sequence_length
    # astype rounds the int64 once, as C++'s float(int64_t) does; np.float32(int)
    # would go through a double first.
    tokens_f32 = np.array(tokens, dtype=np.int64).astype(np.float32)
    return int(np.ceil(tokens_f32 / np.float32(sequence_length)))


def build_sample_idx(
    sizes: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> np.ndarray:
    """The sample index [n + 1, 2] (int64) of index_builders.build_sample_idx."""
    L, e = sequence_length, add_extra_token_to_sequence
    n = count_samples(num_epochs, tokens_per_epoch, L, drop_last_partial_sequence, e)
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    last = len(document_index) - 1

    rows = np.arange(1, n + 1, dtype=np.int64)
    position = np.searchsorted(ends, rows * L + e, side="left")
    past_end = position > last
    # With consistent arguments only a kept last partial sample (row
    # ceil(tokens / L) exactly) and the rows the float32 ceiling adds after it
    # run past the end; a dropped one never does.
    tokens = num_epochs * tokens_per_epoch - e
    first_row_at_end = n + 1 if drop_last_partial_sequence else -(-tokens // L)
    if past_end[: max(first_row_at_end - 1, 0)].any():
        first = int(np.argmax(past_end)) + 1
        raise ValueError(
            f"document_index ran out of tokens at sample {first} of {n}: "
            f"num_epochs={num_epochs} * tokens_per_epoch={tokens_per_epoch} is more than "
            f"the tokens of the sequences it lists ({int(ends[-1])})"
        )
    position = np.minimum(position, last)
    offset = np.where(past_end, lengths[last] - e, rows * L - starts[position])

    sample_index = np.zeros((n + 1, 2), dtype=np.int64)
    sample_index[1:, 0] = position
    sample_index[1:, 1] = offset
    return sample_index


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool = False,
) -> None:
    """index_builders.build_blending_indices as a Python loop (fills in place)."""
    w = [float(x) for x in weights[:num_datasets]]
    counts = [0] * num_datasets
    chosen, chosen_sample = [], []
    for i in range(size):
        x = float(max(i, 1))
        # Python floats are IEEE doubles, so w * x - count rounds as in C++.
        errors = [w[j] * x - counts[j] for j in range(num_datasets)]
        best = errors.index(max(errors))  # the first maximum: ties to the lowest j
        chosen.append(best)
        chosen_sample.append(counts[best])
        counts[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = chosen_sample
    if verbose:
        for j in range(num_datasets):
            print(f"   dataset {j}, input: {w[j]}, achieved: {counts[j] / max(size, 1)}")


def build_exhaustive_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    sizes: np.ndarray,
    num_datasets: int,
) -> None:
    """index_builders.build_exhaustive_blending_indices as a Python loop (fills in place)."""
    size_of = [int(s) for s in sizes[:num_datasets]]
    total = sum(size_of)
    w = [float(s) / float(total) if total else 0.0 for s in size_of]
    counts = [0] * num_datasets
    active = [j for j in range(num_datasets) if size_of[j] > 0]
    chosen, chosen_sample = [], []
    i = 0
    while active:
        x = float(max(i, 1))
        best = max(active, key=lambda j: (w[j] * x - counts[j], -j))
        chosen.append(best)
        chosen_sample.append(counts[best])
        counts[best] += 1
        if counts[best] == size_of[best]:
            active.remove(best)
        i += 1
    dataset_index[:total] = chosen
    dataset_sample_index[:total] = chosen_sample
