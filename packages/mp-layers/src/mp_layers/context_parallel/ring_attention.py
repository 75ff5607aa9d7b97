"""Causal attention over a sequence split across the context-parallel group: each rank
holds its two load-balanced chunks of queries, keys and values (layout.py) and attends
to the keys and values of every rank.

Two ways to reach the other ranks' keys and values (Megatron's --cp-comm-type):

- "p2p" (ring attention, Liu et al., 2023): the local k/v block travels around the
  ring; at step i rank r holds the block of rank r - i. The exchange for step i + 1 is
  posted before step i's blocks are computed, so the transfer overlaps the compute.
  Backward walks the ring again: k/v travel as in forward, and their gradient
  accumulators follow one step behind, picking up each rank's contribution (computed
  while the accumulator is in flight); after the last step each accumulator reaches
  the rank that owns its block.
- "all_gather": every rank's k/v at once (all-gather), and their gradients
  reduce-scattered back to their owners in backward.

Either way, blocks merge by their log-sum-exp (block_math.py) and the load-balanced
layout decides which blocks to compute: at step i > 0 either both query chunks see
the first k/v chunk only (it comes from an earlier rank) or the second query chunk
sees both (a later rank); a quarter of the square is skipped besides the diagonal.

Packed documents (mp_layers.PackedSeqParams) come in one of two ways. `documents`: the
samples are split as above and each block is masked to the pairs within one document;
a block no document spans is skipped. `document_chunks`: every document is split into
2 x cp chunks of its own, the same documents lie side by side in every chunk, and each
block is computed document by document over the document's own rows and keys: the
work is that of the documents' causal attention, whatever their lengths.

Exposed communication: inside `timed_ring_waits()`, every wait on a ring exchange is
timed (the transfer time not hidden behind the block computed meanwhile, plus any
wait for a peer that is late); outside it the waits are untimed.

Shapes: q [s, b, nq, d], k and v [s, b, ng, d], s this rank's tokens (two chunks of
s/2), nq = ng x qg; the output [s, b, nq * d]. Inside, q is [B, qg, s, d] and k, v
[B, s, d] with B = b x ng (block_math.py). Values of another width dv (multi-latent
attention) travel zero-padded, with q and k, to the wider of d and dv (the zero channels
add nothing to q k^T): the output keeps its first dv channels, [s, b, nq * dv].
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_layers.context_parallel.block_math import (
    block_backward,
    block_forward,
    heads_first,
    merge_into,
    sink_per_row,
)
from mp_layers.context_parallel.layout import attention_blocks, local_chunks
from mp_layers.tensor_parallel.collectives import gather_first, reduce_scatter_first
from mp_layers.transformer.eager import eager_when_compiled
from mp_state import RankGroup

__all__ = [
    "CP_COMM_TYPES",
    "RingWaits",
    "context_parallel_attention",
    "dropout_keep",
    "timed_ring_waits",
]

CP_COMM_TYPES = ("p2p", "all_gather")
# Keys and values and their gradients are in flight at once in backward: own tags keep
# the two streams of messages apart.
_KV_TAG, _GRAD_TAG = 1, 2


@dataclass
class RingWaits:
    """Time spent waiting on the ring's exchanges, by what was exchanged: "kv" (keys and
    values, forward and backward) and "grad" (their gradient accumulators, backward)."""

    seconds: dict[str, float] = field(default_factory=lambda: {"kv": 0.0, "grad": 0.0})
    waits: dict[str, int] = field(default_factory=lambda: {"kv": 0, "grad": 0})


_timed: RingWaits | None = None


@contextlib.contextmanager
def timed_ring_waits() -> Iterator[RingWaits]:
    """Times every wait on a p2p ring exchange of this process while inside; yields the
    running totals."""
    global _timed
    if _timed is not None:
        raise RuntimeError("timed_ring_waits() is already timing the ring's waits")
    _timed = RingWaits()
    try:
        yield _timed
    finally:
        _timed = None


# Eager inside a compiled layer: Dynamo does not trace the ring's p2p exchanges (nor
# the timing of their waits); the layer around it is compiled.
@eager_when_compiled
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: RankGroup,
    *,
    scale: float,
    comm_type: str = "p2p",
    documents: torch.Tensor | None = None,
    document_chunks: list[list[tuple[int, int]]] | None = None,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    dropout: float = 0.0,
    dropout_seed: int = 0,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole split sequence. Packed
    sequences (module docstring), either documents: the whole samples' document ids
    [b, cp x s] in the chunk order (position order for the layout above): a query sees
    the earlier keys of its own document only, and a block of two chunks that no
    document spans is skipped; or document_chunks: per sample, the [start, end) of each
    document within a chunk, the same in each. window: each query sees at most `window`
    earlier keys besides its own (a block wholly outside is skipped); sink [nq]: each
    head's sink logit (gpt-oss's learnable softmax offset), in the softmax's sum. dropout:
    attention dropout's probability, the masks of each pair of chunks drawn from
    `dropout_seed` and the pair (`dropout_keep`), again in backward."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm_type!r} must be one of {', '.join(CP_COMM_TYPES)}")
    s, _, nq, _ = q.shape
    if s % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {s} positions")
    if nq % k.shape[2]:
        raise ValueError(f"{nq} query heads cannot share {k.shape[2]} key/value heads")
    d, dv = q.shape[-1], v.shape[-1]
    if documents is not None and tuple(documents.shape) != (q.shape[1], s * cp_group.size):
        raise ValueError(
            f"documents of shape {tuple(documents.shape)} for {q.shape[1]} samples of "
            f"{s * cp_group.size} positions over {cp_group.size} context-parallel ranks"
        )
    if documents is not None and document_chunks is not None:
        raise ValueError("give the packed documents as documents or document_chunks, not both")
    if document_chunks is not None:
        _check_document_chunks(document_chunks, q.shape[1], s // 2)
    if sink is not None and tuple(sink.shape) != (nq,):
        raise ValueError(f"sink of shape {tuple(sink.shape)} for {nq} query heads")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")
    plan = _Plan(documents, document_chunks, s // 2, k.shape[2], q.dtype, q.device, window,
                 (dropout, dropout_seed))  # fmt: skip
    if d == dv:
        return _ContextParallelAttention.apply(q, k, v, sink, cp_group, scale, comm_type, plan)
    # Keys and values travel stacked in one tensor, so of one width (module docstring).
    width = max(d, dv)
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    out = _ContextParallelAttention.apply(q, k, v, sink, cp_group, scale, comm_type, plan)
    return out.view(s, out.shape[1], nq, width)[..., :dv].reshape(s, out.shape[1], nq * dv)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, cp_group: RankGroup, scale: float, comm_type: str, plan):
        s, b, nq, d = q.shape
        ng = k.shape[2]
        rows = q.reshape(s, b, ng, nq // ng, d).permute(1, 2, 3, 0, 4).contiguous()
        rows = rows.view(b * ng, nq // ng, s, d)  # [B, qg, s, d]
        kv = torch.stack([heads_first(k), heads_first(v)])  # [2, B, s, d]
        out = torch.zeros(rows.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(rows.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        q_chunks = local_chunks(cp_group.size, cp_group.rank)
        for source, step_kv in _kv_steps(kv, cp_group, comm_type):
            for piece in plan.pieces(q_chunks, local_chunks(cp_group.size, source)):
                r, qs, ks = piece.rows, piece.q, piece.kv
                block_out, block_lse = block_forward(
                    rows[r, :, qs], step_kv[0][r, ks], step_kv[1][r, ks], piece.causal, scale,
                    piece.bias, plan.keep(piece, rows.shape),
                )  # fmt: skip
                if piece.keyless is not None:  # rows without a key of their document here
                    block_out = block_out.masked_fill(piece.keyless.unsqueeze(-1), 0.0)
                    block_lse = block_lse.masked_fill(piece.keyless, -torch.inf)
                merge_into(out[r, :, qs], lse[r, :, qs], block_out, block_lse)
            plan.forget_keeps()  # a pair's dropout masks serve one step: at most 4 held
        if sink is not None:  # one more term in each row's softmax sum
            merged = torch.logaddexp(lse, sink_per_row(sink, b, ng, nq // ng))
            out.mul_(torch.exp(lse - merged).unsqueeze(-1))
            lse = merged
        ctx.save_for_backward(rows, kv, out, lse, sink)
        ctx.cp_group, ctx.scale, ctx.comm_type, ctx.plan = cp_group, scale, comm_type, plan
        ctx.shape = (s, b, nq, d, ng)
        return _unflat_rows(out.to(q.dtype), s, b, nq, d)

    @staticmethod
    def backward(ctx, grad_out):
        rows, kv, out, lse, sink = ctx.saved_tensors
        group, scale = ctx.cp_group, ctx.scale
        s, b, nq, d, ng = ctx.shape
        dout = grad_out.reshape(s, b, ng, nq // ng, d).permute(1, 2, 3, 0, 4)  # [B, qg, s, d]
        dout = dout.reshape(rows.shape)
        dq = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        q_chunks = local_chunks(group.size, group.rank)

        def accumulate(source: int, step_kv: torch.Tensor, dkv: torch.Tensor) -> None:
            for piece in ctx.plan.pieces(q_chunks, local_chunks(group.size, source)):
                r, qs, ks = piece.rows, piece.q, piece.kv
                dq_, dk_, dv_ = block_backward(
                    rows[r, :, qs], step_kv[0][r, ks], step_kv[1][r, ks], dout[r, :, qs],
                    out[r, :, qs], lse[r, :, qs], piece.causal, scale, piece.bias,
                    ctx.plan.keep(piece, rows.shape),
                )  # fmt: skip
                dq[r, :, qs] += dq_
                dkv[0][r, ks] += dk_
                dkv[1][r, ks] += dv_
            ctx.plan.forget_keeps()

        if ctx.comm_type == "all_gather":
            gathered = _all_gather(kv, group)
            dkvs = torch.zeros(gathered.shape, dtype=torch.float32, device=kv.device)
            for source in range(group.size):
                accumulate(source, gathered[source], dkvs[source])
            dkv = reduce_scatter_first(dkvs, group)[0]
        else:
            # Each block's accumulator travels one step behind its block: at step i the
            # accumulator of the block computed here arrives from the previous rank while
            # this rank computes its contribution into a fresh buffer; it is added on
            # arrival and posted onwards, so its transfer overlaps the next step's compute.
            # After the last step the one that arrives belongs to this rank's own block.
            pending = None
            for source, step_kv in _kv_steps(kv, group, "p2p"):
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                accumulate(source, step_kv, dkv)
                if pending is not None:
                    dkv += pending.wait_result()
                pending = _Exchange(dkv, group, tag=_GRAD_TAG)
            dkv = pending.wait_result()
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out).sum(dim=-1)  # [B, qg, s]
            p_sink = torch.exp(sink_per_row(sink, b, ng, nq // ng) - lse)
            # this rank's queries' part: the data-parallel reduction over dp x cp sums them
            dsink = -(p_sink * delta).view(b, ng, nq // ng, s).sum(dim=(0, 3)).reshape(nq)
            dsink = dsink.to(sink.dtype)
        dk, dv = (_unflat(t.to(kv.dtype), s, b, ng, d) for t in dkv)
        dq = _unflat_rows(dq.to(rows.dtype), s, b, nq, d).view(s, b, nq, d)
        return dq, dk, dv, dsink, None, None, None, None


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
    generator.manual_seed((seed * 1_000_003 + q_chunk * 65_537 + kv_chunk) % (1 << 63))
    kept = torch.empty(shape, device=device).bernoulli_(1.0 - p, generator=generator)
    return kept.mul_(1.0 / (1.0 - p))


_WHOLE = object()
"""A document's piece that the window does not cut (_Plan._document_band)."""


class _Plan:
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


def _check_document_chunks(document_chunks, b: int, chunk: int) -> None:
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


def _kv_steps(kv: torch.Tensor, group: RankGroup, comm_type: str):
    """(source rank, its k/v block [2, B, s, d]) for every rank of the group, in the order
    the comm type delivers them; p2p posts each next exchange before yielding a block."""
    if group.size == 1:
        yield 0, kv
        return
    if comm_type == "all_gather":
        yield from enumerate(_all_gather(kv, group))
        return
    for step in range(group.size):
        pending = _Exchange(kv, group, tag=_KV_TAG) if step + 1 < group.size else None
        yield (group.rank - step) % group.size, kv
        if pending is not None:
            kv = pending.wait_result()


def _all_gather(kv: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """[2, B, s, d] -> [cp, 2, B, s, d]: every rank's block, in rank order."""
    return gather_first(kv.unsqueeze(0), group)


class _Exchange:
    """A posted send to the next rank of the ring and receive from the previous one."""

    def __init__(self, tensor: torch.Tensor, group: RankGroup, tag: int) -> None:
        self.received = torch.empty_like(tensor)
        self.kind = "kv" if tag == _KV_TAG else "grad"
        if group.size == 1:
            self.received.copy_(tensor)
            self.requests = []
            return
        nxt = group.ranks[(group.rank + 1) % group.size]
        prev = group.ranks[(group.rank - 1) % group.size]
        self.requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor.contiguous(), nxt, group.group, tag),
                dist.P2POp(dist.irecv, self.received, prev, group.group, tag),
            ]
        )

    def wait_result(self) -> torch.Tensor:
        timed = _timed
        start = time.perf_counter() if timed is not None else 0.0
        for request in self.requests:
            request.wait()
        if timed is not None:
            timed.seconds[self.kind] += time.perf_counter() - start
            timed.waits[self.kind] += 1
        return self.received


def _unflat(x: torch.Tensor, s: int, b: int, ng: int, d: int) -> torch.Tensor:
    """[b * ng, s, d] -> [s, b, ng, d]."""
    return x.view(b, ng, s, d).permute(2, 0, 1, 3).contiguous()


def _unflat_rows(x: torch.Tensor, s: int, b: int, nq: int, d: int) -> torch.Tensor:
    """[b * ng, qg, s, d] -> [s, b, nq * d] (each group's query heads adjacent)."""
    ng = x.shape[0] // b
    return x.view(b, ng, nq // ng, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, nq * d)
