"""Which pieces of attention between two load-balanced chunks a context-parallel rank
computes, and what each piece needs (ring_attention.py runs them): the layout's blocks
(layout.py), masked to packed documents and to a sliding window, or cut into the
documents of a sample split by document, and attention dropout's multipliers of each
pair of chunks, drawn from a seed and the pair alone (`dropout_keep`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mp_layers.context_parallel.layout import attention_blocks

__all__ = ["BlockPlan", "check_document_chunks", "dropout_keep", "mixed_seed"]


def mixed_seed(seed: int, *parts: int) -> int:
    """A generator seed from `seed` and integers naming what draws with it (a pair of
    chunks, a rank): another for each, the same on every rank that computes it."""
    for part in parts:
        seed = seed * 1_000_003 + part
    return seed % (1 << 63)


class _Piece(NamedTuple):
    """One block_forward / block_backward call: query rows `rows` (of B = b x ng) at
    local positions `q` against the keys at `kv` of the k/v block in hand."""

    rows: slice
    q: slice
    kv: slice
    causal: bool
    bias: torch.Tensor | None = None
    keyless: torch.Tensor | None = None
    """[B', 1, c] bool: the rows that see no key of the piece (their output is none)."""
    chunks: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(query chunk, key chunk, local position of each): the global chunks the piece lies
    in and where they start in the local q and in the k/v block."""


def dropout_keep(seed: int, q_chunk: int, kv_chunk: int, shape: tuple[int, ...], p: float,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
    """Attention dropout's multipliers [B, qg, c, c] fp32 (0 dropped, 1 / (1 - p) kept)
    between global chunks q_chunk and kv_chunk of a sequence cut into 2 x cp chunks of c
    positions, drawn from `seed` and the pair alone: the same in forward and backward,
    whatever rank computes the pair."""
    generator = torch.Generator(device=device)
    generator.manual_seed(mixed_seed(seed, q_chunk, kv_chunk))
    kept = torch.empty(shape, device=device).bernoulli_(1.0 - p, generator=generator)
    return kept.mul_(1.0 / (1.0 - p))


_WHOLE = object()
"""A document's piece that the window does not cut (BlockPlan._document_band)."""


class BlockPlan:
    """The pieces to compute between this rank's query chunks and the chunks of a k/v
    block: the layout's blocks, masked to documents (`documents`) and to a sliding
    `window`, cut into documents (`document_chunks`), or whole."""

    def __init__(self, documents, document_chunks, chunk: int, ng: int, dtype, device,
                 window: int | None = None,
                 dropout: tuple[float, int] = (0.0, 0)) -> None:  # fmt: skip
        """dropout: (probability, seed)."""
        self.chunk, self.ng, self.window = chunk, ng, window
        (self.dropout, self.dropout_seed), self.device = dropout, device
        self._keeps: dict[tuple[int, int], torch.Tensor] = {}
        self._bands: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.masks = None
        if documents is not None or window is not None:
            self.masks = _BlockMasks(documents, window, chunk, ng, dtype, device)
        self.document_chunks = document_chunks

    def keep(self, piece: _Piece, rows_shape: torch.Size) -> torch.Tensor | None:
        """The piece's dropout multipliers (dropout_keep of its pair of chunks, cut to the
        piece), or None without dropout."""
        if self.dropout == 0:
            return None
        a, c_kv, q0, kv0 = piece.chunks
        if (a, c_kv) not in self._keeps:
            shape = (*rows_shape[:2], self.chunk, self.chunk)  # [B, qg, c, c]
            self._keeps[(a, c_kv)] = dropout_keep(self.dropout_seed, a, c_kv, shape,
                                                  self.dropout, self.device)  # fmt: skip
        keep = self._keeps[(a, c_kv)]
        qs = slice(piece.q.start - q0, piece.q.stop - q0)
        ks = slice(piece.kv.start - kv0, piece.kv.stop - kv0)
        return keep[piece.rows, :, qs, ks]

    def _document_band(self, q_chunk: int, kv_chunk: int, n: int):
        """A document's piece between its chunks q_chunk and kv_chunk (n positions each: the
        document cut into 2 x cp chunks of its own) under the window: _WHOLE where every
        pair is within it (or there is no window), None where none is, else (bias [n, n],
        keyless [1, 1, n]), the pairs at most `window` positions apart and not later."""
        if self.window is None:
            return _WHOLE
        gap = (q_chunk - kv_chunk) * n  # how far the key chunk starts before the query's
        if gap - (n - 1) > self.window:
            return None
        if gap + n - 1 <= self.window:
            return _WHOLE
        key = (gap, n)
        if key not in self._bands:
            i = torch.arange(n, device=self.device)
            apart = gap + i[:, None] - i[None, :]
            allowed = (apart >= 0) & (apart <= self.window)
            bias = torch.zeros((n, n), dtype=self.masks.dtype, device=self.device)
            bias.masked_fill_(~allowed, -torch.inf)
            self._bands[key] = (bias, ~allowed.any(-1).view(1, 1, n))
        return self._bands[key]

    def forget_keeps(self) -> None:
        """Frees the dropout multipliers drawn so far (they are drawn again on demand)."""
        self._keeps.clear()

    def pieces(self, q_chunks: tuple[int, int], kv_chunks: tuple[int, int]):
        c, every = self.chunk, slice(None)
        for block in attention_blocks(q_chunks, kv_chunks):
            causal = block.kind == "causal"
            q0, kv0 = block.q_half * c, block.kv_half * c
            where = (q_chunks[block.q_half], kv_chunks[block.kv_half], q0, kv0)
            if self.document_chunks is not None:
                for i, documents in enumerate(self.document_chunks):
                    rows = slice(i * self.ng, (i + 1) * self.ng)
                    for a, e in documents:
                        q, kv = slice(q0 + a, q0 + e), slice(kv0 + a, kv0 + e)
                        band = self._document_band(where[0], where[1], e - a)
                        if band is None:  # the window does not reach into the block
                            continue
                        if band is _WHOLE:
                            yield _Piece(rows, q, kv, causal, chunks=where)
                        else:  # causality is folded into the band
                            yield _Piece(rows, q, kv, False, *band, chunks=where)
                continue
            whole_q, whole_kv = slice(q0, q0 + c), slice(kv0, kv0 + c)
            if self.masks is None:
                yield _Piece(every, whole_q, whole_kv, causal, chunks=where)
                continue
            a, b = q_chunks[block.q_half], kv_chunks[block.kv_half]
            if self.masks.whole(a, b):  # every pair of the block within the window
                yield _Piece(every, whole_q, whole_kv, causal, chunks=where)
                continue
            bias = self.masks.bias(a, b, causal)
            if bias is not None:  # causality is folded into the bias
                keyless = self.masks.keyless(a, b, causal)
                yield _Piece(every, whole_q, whole_kv, False, bias, keyless, where)


class _BlockMasks:
    """Which keys each query sees between two chunks: its document's (packed samples), at
    most `window` positions back (a sliding window), and only earlier ones on the
    diagonal. Without documents the masks are the samples' common [1, c, c]."""

    def __init__(self, documents: torch.Tensor | None, window: int | None, chunk: int,
                 ng: int, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.documents, self.window, self.chunk, self.ng = documents, window, chunk, ng
        self.dtype, self.device = dtype, device
        self._allowed: dict[tuple[int, int, bool], torch.Tensor] = {}

    def whole(self, q_chunk: int, kv_chunk: int) -> bool:
        """Whether the block needs no mask beyond causality: no documents, and every key
        of the chunk within the window of every query of the other."""
        if self.documents is not None:
            return False
        return self.window is None or (q_chunk - kv_chunk + 1) * self.chunk - 1 <= self.window

    def allowed(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor:
        """[b or 1, c, c] bool: query i of chunk q_chunk sees key j of chunk kv_chunk."""
        key = (q_chunk, kv_chunk, causal)
        if key not in self._allowed:
            c = self.chunk
            queries = torch.arange(q_chunk * c, (q_chunk + 1) * c, device=self.device)[:, None]
            keys = torch.arange(kv_chunk * c, (kv_chunk + 1) * c, device=self.device)[None, :]
            allowed = (keys <= queries)[None]
            if self.window is not None:
                allowed &= (keys >= queries - self.window)[None]
            if self.documents is not None:
                q_ids = self.documents[:, q_chunk * c : (q_chunk + 1) * c]
                kv_ids = self.documents[:, kv_chunk * c : (kv_chunk + 1) * c]
                allowed = allowed & (q_ids[:, :, None] == kv_ids[:, None, :])
            self._allowed[key] = allowed
        return self._allowed[key]

    def bias(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor | None:
        """[B or 1, 1, c, c] (0 or -inf) over the block's scores, B = b x ng; None when no
        query sees any key (the block is skipped)."""
        allowed = self.allowed(q_chunk, kv_chunk, causal)
        if not bool(allowed.any()):
            return None
        b, c, _ = allowed.shape
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        bias.masked_fill_(~allowed, -torch.inf)
        if b == 1:  # the same for every sample and head
            return bias[0]
        return bias[:, None, None].expand(b, self.ng, 1, c, c).reshape(b * self.ng, 1, c, c)

    def keyless(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor:
        """[B or 1, 1, c] bool: the queries that see no key of the block."""
        empty = ~self.allowed(q_chunk, kv_chunk, causal).any(-1)  # [b, c]
        b, c = empty.shape
        if b == 1:
            return empty.view(1, 1, c)
        return empty[:, None, None].expand(b, self.ng, 1, c).reshape(b * self.ng, 1, c)


def check_document_chunks(document_chunks, b: int, chunk: int) -> None:
    """Each of the b samples' documents must tile one chunk of `chunk` positions."""
    if len(document_chunks) != b:
        raise ValueError(f"document_chunks for {len(document_chunks)} samples, queries of {b}")
    for i, documents in enumerate(document_chunks):
        ends = [0, *(e for _, e in documents)]
        if [a for a, _ in documents] != ends[:-1] or ends[-1] != chunk:
            raise ValueError(
                f"document_chunks of sample {i}, {documents}, do not tile a chunk of "
                f"{chunk} positions"
            )
