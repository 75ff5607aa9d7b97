"""The three index arrays of a GPT dataset, built exactly as Megatron builds them.

Names: L the sequence length, e = 1 when each sample carries one extra token
(its last label), N the samples requested (None: one epoch), T the tokens of
the split's sequences, E the epochs.

- document_index (int32): the split's sequence ids repeated E times and
  shuffled; when the last epoch is only partly used it is shuffled on its
  own, so its documents are not spread over the whole run.
- sample_index ([n+1, 2]): where each sample starts, as (position in the
  document index, token offset); built natively (index_builders).
- shuffle_index: a permutation of the n samples; with a separate last epoch,
  the samples before it and those in it are shuffled apart.

One numpy RandomState(seed) draws, in this order: the document shuffle(s),
then the shuffle index's first range, then its second. Same data, seed and
settings: same arrays as Megatron, so the same samples in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mp_data.index_builders import build_sample_idx

__all__ = ["GPTIndices", "build_gpt_indices", "epochs_needed", "separate_final_epoch"]

_FINAL_EPOCH_THRESHOLD = 0.80
"""A last epoch used for less than this fraction is shuffled separately (Megatron's)."""


@dataclass(frozen=True)
class GPTIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray


def epochs_needed(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int
) -> int:
    """The smallest E >= 1 with E * T >= N * L + e (1 when N is None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError(f"{num_samples} samples were asked of a split with no tokens")
    wanted = num_samples * seq_length + extra
    return max(1, -(-wanted // tokens_per_epoch))


def separate_final_epoch(
    epochs: int, tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int
) -> bool:
    """Whether the last epoch is used for less than 80% of its samples."""
    if epochs == 1 or num_samples is None:
        return False
    before_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    per_epoch = (tokens_per_epoch - extra) // seq_length
    from_final = num_samples - before_final
    # Holds by the choice of E; a failure means the inputs disagree.
    if not 0 <= from_final <= per_epoch + 1:
        raise ValueError(
            f"{from_final} samples from the last of {epochs} epochs of {per_epoch} samples"
        )
    return from_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    sequence_ids: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
) -> GPTIndices:
    """All three indices for the sequences `sequence_ids` of a dataset."""
    extra = int(add_extra_token)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    ids = np.asarray(sequence_ids, dtype=np.int32)
    tokens_per_epoch = int(np.sum(lengths[ids], dtype=np.int64))
    epochs = epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    separate = separate_final_epoch(epochs, tokens_per_epoch, num_samples, seq_length, extra)

    rng = np.random.RandomState(seed)
    if separate:
        document_index = np.concatenate(
            [_document_index(ids, epochs - 1, rng), _document_index(ids, 1, rng)]
        )
    else:
        document_index = _document_index(ids, epochs, rng)

    # Reading the lengths many times from a memory map is slow; copy when dense.
    if len(document_index) * 2 > len(lengths):
        lengths = np.array(lengths)
    sample_index = build_sample_idx(
        lengths,
        document_index,
        seq_length,
        epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        extra,
    )
    samples = sample_index.shape[0] - 1
    if separate:
        before_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
        shuffle_index = _shuffle_index(before_final, samples, rng)
    else:
        shuffle_index = _shuffle_index(samples, samples, rng)
    return GPTIndices(document_index, sample_index, shuffle_index)


def _document_index(ids: np.ndarray, epochs: int, rng: np.random.RandomState) -> np.ndarray:
    index = np.tile(ids, epochs).astype(np.int32, copy=False)
    rng.shuffle(index)
    return index


def _shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])
