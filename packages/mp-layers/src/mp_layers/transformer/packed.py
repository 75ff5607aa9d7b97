"""Packed sequences: several documents in one sample, each attended on its own.

    packed = PackedSeqParams.from_document_ids(document_ids)  # [b, s]: 0,0,0,1,1,2,...
    loss = model(tokens, position_ids, packed, labels=labels)

A sample's tokens are split into documents by `document_ids`: a document is a
run of equal ids. Attention is causal within each document and never crosses
one (core attention runs each document of each sample as a sequence of its
own, so its cost and memory grow with the documents' lengths, not the
sample's), and rotary positions restart at 0 at each document's first token,
as Megatron's packed (THD) format does. Passed where a dense attention mask
would go: GPTModel.forward's attention_mask.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

__all__ = ["PackedSeqParams"]


@dataclass(frozen=True, eq=False)
class PackedSeqParams:
    """The documents of a micro-batch (Megatron's PackedSeqParams, as per-token ids)."""

    document_ids: torch.Tensor
    """[b, s] integers: the document of each token; a document is a run of equal ids."""

    positions: torch.Tensor
    """[b, s] int64: each token's position within its document (0 at its first token)."""

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> PackedSeqParams:
        """The documents of `document_ids` [b, s], and the positions within them."""
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [b, s], got shape {tuple(document_ids.shape)}")
        index = torch.arange(document_ids.shape[1], device=document_ids.device)
        index = index.expand_as(document_ids)
        starts = torch.zeros_like(index)
        starts[:, 1:] = torch.where(document_ids[:, 1:] != document_ids[:, :-1], index[:, 1:], 0)
        return cls(document_ids, index - starts.cummax(dim=1).values)

    @functools.cached_property
    def segments(self) -> list[list[tuple[int, int]]]:
        """Per sample, the [start, end) of each document, in order."""
        ids = self.document_ids
        change = (ids[:, 1:] != ids[:, :-1]).cpu()
        s = ids.shape[1]
        found = []
        for row in change:
            cuts = [0, *(torch.nonzero(row).flatten() + 1).tolist(), s]
            found.append(list(itertools.pairwise(cuts)))
        return found

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The documents' cumulative lengths over the flattened batch, int32 [n + 1]
        (Megatron's cu_seqlens of the THD format)."""
        s = self.document_ids.shape[1]
        ends = [i * s + end for i, row in enumerate(self.segments) for _, end in row]
        return torch.tensor([0, *ends], dtype=torch.int32)
