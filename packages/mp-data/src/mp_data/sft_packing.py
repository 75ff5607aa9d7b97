"""Packing conversations into fixed-length samples, and one packed sample's tensors.

The plan (`pack_conversations`) is computed from the conversations' lengths
alone: greedy in the order given, a conversation joins the current sample
when it fits in what is left, else it opens the next one; a conversation
longer than a whole sample gets one of its own, truncated. No conversation
that fits is ever split.

Under context parallelism each conversation is padded to a multiple of
2 x cp tokens (`multiple`, Megatron's SFTDataset: the padding is part of the
conversation's document, with no loss), so that every document can be split
into 2 x cp equal chunks; the plan packs the padded lengths.

A sample holds sequence_length + 1 tokens, as Megatron's SFTDataset packs
them: the inputs are the first sequence_length, the labels the last
sequence_length. Its tensors, s = sequence_length:

    tokens [s] int64, labels [s] int64 (tokens shifted by one),
    loss_mask [s] float32: 1 where the label is an assistant token of the same
        conversation (Megatron: the target is not IGNORE_INDEX), else 0,
    position_ids [s] int64: restarting at 0 with each conversation,
    document_ids [s] int64: the conversation's index in the sample, 0, 0, 1, ...;
        the padding after the last conversation is a document of its own. Attention
        stays within a document (mp_layers.PackedSeqParams reads them).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["pack_conversations", "packed_sample", "padded_lengths"]


def padded_lengths(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of `multiple`."""
    return -(-lengths // multiple) * multiple


def pack_conversations(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Sample boundaries [n_samples + 1]: sample j holds conversations bounds[j]:bounds[j+1]."""
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    bounds = [0]
    used = 0
    for i, length in enumerate(lengths.tolist()):
        if used and used + length > capacity:
            bounds.append(i)
            used = 0
        used += length
    if used:  # else every conversation is empty: no sample
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def packed_sample(
    parts: list[tuple[np.ndarray, np.ndarray]],
    sequence_length: int,
    pad: int,
    eod: int | None = None,
    eod_mask_loss: bool = False,
    multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """The tensors of one sample from its conversations' (ids, assistant) in order, each
    padded to a multiple of `multiple` tokens and cut to the sample's sequence_length + 1
    tokens."""
    size = sequence_length + 1
    ids = np.full(size, pad, dtype=np.int64)
    assistant = np.zeros(size, dtype=bool)
    document = np.zeros(size, dtype=np.int64)
    position = np.zeros(size, dtype=np.int64)
    end, d = 0, 0
    for tokens, mask in parts:
        n = min(len(tokens), size - end)
        if n == 0:
            continue
        ids[end : end + n] = tokens[:n]
        assistant[end : end + n] = mask[:n]
        n = min(int(padded_lengths(np.int64(n), multiple)), size - end)  # pad: ids stay pad
        document[end : end + n] = d
        position[end : end + n] = np.arange(n)
        end, d = end + n, d + 1
    document[end:] = d  # the padding: one more document
    position[end:] = np.arange(size - end)
    same = document[1:] == document[:-1]
    loss_mask = (assistant[1:] & same).astype(np.float32)
    labels = ids[1:]
    if eod_mask_loss and eod is not None:
        loss_mask[labels == eod] = 0.0
    return {
        "tokens": torch.from_numpy(ids[:-1].copy()),
        "labels": torch.from_numpy(labels.copy()),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position[:-1].copy()),
        "document_ids": torch.from_numpy(document[:-1].copy()),
    }
