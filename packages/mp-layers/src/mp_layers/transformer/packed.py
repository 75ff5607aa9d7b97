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

Under context parallelism each rank holds its two load-balanced chunks of every
sample (context_parallel/layout.py), as without packing: `from_document_ids`
takes the whole samples' ids with the rank's place, keeps them
(`whole_document_ids`, for the attention across ranks) and gives the rank's
own tokens' ids and positions. Attention between two ranks' chunks is masked
to the pairs within one document (and causal), and a block of chunks that no
document spans is skipped.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from mp_layers.context_parallel.layout import shard_sequence

__all__ = ["PackedSeqParams"]


@dataclass(frozen=True, eq=False)
class PackedSeqParams:
    """The documents of a micro-batch (Megatron's PackedSeqParams, as per-token ids)."""

    document_ids: torch.Tensor
    """[b, s] integers: the document of each token; a document is a run of equal ids."""

    positions: torch.Tensor
    """[b, s] int64: each token's position within its document (0 at its first token)."""

    whole_document_ids: torch.Tensor | None = None
    """With context parallelism: the whole samples' ids [b, cp x s], in position order."""

    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def from_document_ids(
        cls, document_ids: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
    ) -> PackedSeqParams:
        """The documents of `document_ids` [b, S] (whole samples), and the positions
        within them; with cp_size > 1, of this context-parallel rank's tokens."""
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be [b, s], got shape {tuple(document_ids.shape)}")
        index = torch.arange(document_ids.shape[1], device=document_ids.device)
        index = index.expand_as(document_ids)
        starts = torch.zeros_like(index)
        starts[:, 1:] = torch.where(document_ids[:, 1:] != document_ids[:, :-1], index[:, 1:], 0)
        positions = index - starts.cummax(dim=1).values
        if cp_size == 1:
            return cls(document_ids, positions)
        local = (shard_sequence(t, cp_size, cp_rank, dim=1) for t in (document_ids, positions))
        return cls(*local, document_ids, cp_size, cp_rank)

    def whole(self) -> PackedSeqParams:
        """The whole samples' documents (itself without context parallelism)."""
        if self.whole_document_ids is None:
            return self
        return PackedSeqParams.from_document_ids(self.whole_document_ids)

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
