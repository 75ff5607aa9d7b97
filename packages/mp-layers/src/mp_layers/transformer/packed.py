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

Under context parallelism `from_document_ids` takes the whole samples' ids with
the rank's place and chooses how the samples are split (`split`):

- "document", when every document of every sample has a length divisible by
  2 x cp (Megatron's rule for packed sequences under context parallelism; mp's
  SFT samples pad each conversation to it): each document is cut into 2 x cp
  equal chunks and rank r keeps chunks r and 2cp-1-r of every document, so each
  rank does the same share of every document's causal attention however long
  the documents are. Attention then runs document by document inside each block
  of the ring, never over pairs of two documents.
- "sample" otherwise (documents cut anywhere, as --reset-attention-mask gives):
  the samples are split as without packing (context_parallel/layout.py), and
  each block of the ring is masked to the pairs within one document; a block
  that no document spans is skipped.

Both are one picture: the sample's positions are put in a *chunk order*
(`order`; the positions themselves for "sample"), in which the 2 x cp equal
chunks of the layout are the ranks' chunks. For "document", chunk k of the
chunk order is chunk k of every document, side by side. `shard` gives this
rank's part of any [b, S] tensor of the batch (tokens, labels, loss mask,
position ids), so that every tensor travels with its tokens.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Literal

import torch

from mp_layers.context_parallel.layout import shard_sequence

__all__ = ["PackedSeqParams"]


@dataclass(frozen=True, eq=False)
class PackedSeqParams:
    """The documents of a micro-batch (Megatron's PackedSeqParams, as per-token ids)."""

    document_ids: torch.Tensor
    """[b, s] integers: the document of each token; a document is a run of equal ids
    (with context parallelism, of this rank's tokens: each document's number in its
    sample)."""

    positions: torch.Tensor
    """[b, s] int64: each token's position within its document (0 at its first token)."""

    whole_document_ids: torch.Tensor | None = None
    """With context parallelism: the whole samples' document numbers [b, cp x s], in
    chunk order."""

    cp_size: int = 1
    cp_rank: int = 0

    order: torch.Tensor | None = None
    """With context parallelism split by document: [b, cp x s] int64, the sample
    position at each place of the chunk order; None when the chunk order is the
    positions' own."""

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
        change = document_ids[:, 1:] != document_ids[:, :-1]
        starts = torch.zeros_like(index)
        starts[:, 1:] = torch.where(change, index[:, 1:], 0)
        positions = index - starts.cummax(dim=1).values
        if cp_size == 1:
            return cls(document_ids, positions)
        numbers = torch.zeros_like(index)
        numbers[:, 1:] = change.cumsum(dim=1)
        order = _document_order(numbers, 2 * cp_size)
        if order is not None:
            numbers, positions = (t.gather(1, order) for t in (numbers, positions))
        local = (shard_sequence(t, cp_size, cp_rank, dim=1) for t in (numbers, positions))
        return cls(*local, numbers, cp_size, cp_rank, order)

    @property
    def split(self) -> Literal["document", "sample"]:
        """How context parallelism splits the samples (module docstring)."""
        return "sample" if self.order is None else "document"

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a [b, S] tensor of the whole samples, in the order of its
        tokens here (the tensor itself without context parallelism)."""
        if self.cp_size == 1:
            return tensor
        if self.order is not None:
            tensor = tensor.gather(1, self.order.to(tensor.device))
        return shard_sequence(tensor, self.cp_size, self.cp_rank, dim=1)

    def whole(self) -> PackedSeqParams:
        """The whole samples' documents, in position order (itself without context
        parallelism); computed once, for every layer of the micro-batch."""
        return self._whole

    @functools.cached_property
    def _whole(self) -> PackedSeqParams:
        if self.whole_document_ids is None:
            return self
        ids = self.whole_document_ids
        if self.order is not None:
            ids = torch.empty_like(ids).scatter_(1, self.order, ids)
        return PackedSeqParams.from_document_ids(ids)

    @functools.cached_property
    def segments(self) -> list[list[tuple[int, int]]]:
        """Per sample, the [start, end) of each document, in order."""
        return _runs(self.document_ids)

    @functools.cached_property
    def chunk_segments(self) -> list[list[tuple[int, int]]]:
        """Split by document: per sample, the [start, end) of each document within one
        chunk of the chunk order (the same in every chunk, on every rank)."""
        if self.order is None or self.whole_document_ids is None:
            raise ValueError("chunk_segments: the samples are not split by document")
        chunk = self.whole_document_ids.shape[1] // (2 * self.cp_size)
        return _runs(self.whole_document_ids[:, :chunk])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The documents' cumulative lengths over the flattened batch, int32 [n + 1]
        (Megatron's cu_seqlens of the THD format)."""
        s = self.document_ids.shape[1]
        ends = [i * s + end for i, row in enumerate(self.segments) for _, end in row]
        return torch.tensor([0, *ends], dtype=torch.int32)


def _runs(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ids [b, s], the [start, end) of each run of equal ids."""
    change = (ids[:, 1:] != ids[:, :-1]).cpu()
    s = ids.shape[1]
    found = []
    for row in change:
        cuts = [0, *(torch.nonzero(row).flatten() + 1).tolist(), s]
        found.append(list(itertools.pairwise(cuts)))
    return found


def _document_order(numbers: torch.Tensor, chunks: int) -> torch.Tensor | None:
    """The chunk order [b, S] that cuts every document (runs of `numbers`) into `chunks`
    equal pieces, piece k of every document in chunk k; None unless every document's
    length is divisible by `chunks`."""
    rows = []
    for row, runs in zip(numbers, _runs(numbers), strict=True):
        if any((end - start) % chunks for start, end in runs):
            return None
        pieces = [
            torch.arange(start, end, device=row.device).view(chunks, (end - start) // chunks)
            for start, end in runs
        ]
        rows.append(torch.cat(pieces, dim=1).flatten())
    return torch.stack(rows)
