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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_layers.context_parallel.block_math import (
    block_backward,
    block_forward,
    heads_first,
    merge_into,
)
from mp_layers.context_parallel.layout import attention_blocks, local_chunks
from mp_layers.tensor_parallel.collectives import gather_first, reduce_scatter_first
from mp_layers.transformer.eager import eager_when_compiled
from mp_state import RankGroup

__all__ = ["CP_COMM_TYPES", "RingWaits", "context_parallel_attention", "timed_ring_waits"]

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
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole split sequence. documents:
    the whole samples' document ids [b, cp x s] (packed sequences, in position order):
    a query sees the earlier keys of its own document only, and a block of two chunks
    that no document spans is skipped."""
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
    if d == dv:
        return _ContextParallelAttention.apply(q, k, v, cp_group, scale, comm_type, documents)
    # Keys and values travel stacked in one tensor, so of one width (module docstring).
    width = max(d, dv)
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    out = _ContextParallelAttention.apply(q, k, v, cp_group, scale, comm_type, documents)
    return out.view(s, out.shape[1], nq, width)[..., :dv].reshape(s, out.shape[1], nq * dv)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_group: RankGroup, scale: float, comm_type: str, documents):
        s, b, nq, d = q.shape
        ng = k.shape[2]
        masks = None if documents is None else _DocumentMasks(documents, s // 2, ng, q.dtype)
        rows = q.reshape(s, b, ng, nq // ng, d).permute(1, 2, 3, 0, 4).contiguous()
        rows = rows.view(b * ng, nq // ng, s, d)  # [B, qg, s, d]
        kv = torch.stack([heads_first(k), heads_first(v)])  # [2, B, s, d]
        out = torch.zeros(rows.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(rows.shape[:-1], -torch.inf, dtype=torch.float32, device=q.device)
        q_chunks = local_chunks(cp_group.size, cp_group.rank)
        for source, step_kv in _kv_steps(kv, cp_group, comm_type):
            kv_chunks = local_chunks(cp_group.size, source)
            for block, causal, bias in _blocks(q_chunks, kv_chunks, masks):
                qs, ks = _half(s, block.q_half), _half(s, block.kv_half)
                block_out, block_lse = block_forward(
                    rows[:, :, qs], step_kv[0][:, ks], step_kv[1][:, ks], causal, scale, bias
                )
                if bias is not None:  # rows without a key of their document here: nothing
                    empty = masks.keyless(q_chunks[block.q_half], kv_chunks[block.kv_half],
                                          block.kind == "causal")  # fmt: skip
                    block_out = block_out.masked_fill(empty.unsqueeze(-1), 0.0)
                    block_lse = block_lse.masked_fill(empty, -torch.inf)
                merge_into(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        ctx.save_for_backward(rows, kv, out, lse)
        ctx.cp_group, ctx.scale, ctx.comm_type, ctx.masks = cp_group, scale, comm_type, masks
        ctx.shape = (s, b, nq, d, ng)
        return _unflat_rows(out.to(q.dtype), s, b, nq, d)

    @staticmethod
    def backward(ctx, grad_out):
        rows, kv, out, lse = ctx.saved_tensors
        group, scale = ctx.cp_group, ctx.scale
        s, b, nq, d, ng = ctx.shape
        dout = grad_out.reshape(s, b, ng, nq // ng, d).permute(1, 2, 3, 0, 4)  # [B, qg, s, d]
        dout = dout.reshape(rows.shape)
        dq = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        q_chunks = local_chunks(group.size, group.rank)

        def accumulate(source: int, step_kv: torch.Tensor, dkv: torch.Tensor) -> None:
            for block, causal, bias in _blocks(q_chunks, local_chunks(group.size, source),
                                               ctx.masks):  # fmt: skip
                qs, ks = _half(s, block.q_half), _half(s, block.kv_half)
                dq_, dk_, dv_ = block_backward(
                    rows[:, :, qs], step_kv[0][:, ks], step_kv[1][:, ks], dout[:, :, qs],
                    out[:, :, qs], lse[:, :, qs], causal, scale, bias,
                )  # fmt: skip
                dq[:, :, qs] += dq_
                dkv[0][:, ks] += dk_
                dkv[1][:, ks] += dv_

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
        dk, dv = (_unflat(t.to(kv.dtype), s, b, ng, d) for t in dkv)
        dq = _unflat_rows(dq.to(rows.dtype), s, b, nq, d).view(s, b, nq, d)
        return dq, dk, dv, None, None, None, None


def _blocks(q_chunks: tuple[int, int], kv_chunks: tuple[int, int], masks):
    """(block, causal, bias) for each block to compute: the layout's, and with packed
    documents only those some document spans, each with its documents' bias (causality
    folded in)."""
    for block in attention_blocks(q_chunks, kv_chunks):
        causal = block.kind == "causal"
        if masks is None:
            yield block, causal, None
            continue
        bias = masks.bias(q_chunks[block.q_half], kv_chunks[block.kv_half], causal)
        if bias is not None:
            yield block, False, bias


class _DocumentMasks:
    """Which keys each query sees between two chunks of packed samples: its document's,
    and only earlier ones on the diagonal."""

    def __init__(self, documents: torch.Tensor, chunk: int, ng: int, dtype: torch.dtype) -> None:
        self.documents, self.chunk, self.ng, self.dtype = documents, chunk, ng, dtype
        self._allowed: dict[tuple[int, int, bool], torch.Tensor] = {}

    def allowed(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor:
        """[b, c, c] bool: query i of chunk q_chunk sees key j of chunk kv_chunk."""
        key = (q_chunk, kv_chunk, causal)
        if key not in self._allowed:
            c = self.chunk
            q_ids = self.documents[:, q_chunk * c : (q_chunk + 1) * c]
            kv_ids = self.documents[:, kv_chunk * c : (kv_chunk + 1) * c]
            allowed = q_ids[:, :, None] == kv_ids[:, None, :]
            if causal:
                allowed &= torch.ones(c, c, dtype=torch.bool, device=allowed.device).tril_()
            self._allowed[key] = allowed
        return self._allowed[key]

    def bias(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor | None:
        """[B, 1, c, c] (0 or -inf) over the block's scores, B = b x ng; None when no
        query sees any key (the block is skipped)."""
        allowed = self.allowed(q_chunk, kv_chunk, causal)
        if not bool(allowed.any()):
            return None
        b, c, _ = allowed.shape
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        bias.masked_fill_(~allowed, -torch.inf)
        return bias[:, None, None].expand(b, self.ng, 1, c, c).reshape(b * self.ng, 1, c, c)

    def keyless(self, q_chunk: int, kv_chunk: int, causal: bool) -> torch.Tensor:
        """[B, 1, c] bool: the queries that see no key of the block."""
        empty = ~self.allowed(q_chunk, kv_chunk, causal).any(-1)  # [b, c]
        b, c = empty.shape
        return empty[:, None, None].expand(b, self.ng, 1, c).reshape(b * self.ng, 1, c)


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


def _half(s: int, half: int) -> slice:
    return slice(half * (s // 2), (half + 1) * (s // 2))


def _unflat(x: torch.Tensor, s: int, b: int, ng: int, d: int) -> torch.Tensor:
    """[b * ng, s, d] -> [s, b, ng, d]."""
    return x.view(b, ng, s, d).permute(2, 0, 1, 3).contiguous()


def _unflat_rows(x: torch.Tensor, s: int, b: int, nq: int, d: int) -> torch.Tensor:
    """[b * ng, qg, s, d] -> [s, b, nq * d] (each group's query heads adjacent)."""
    ng = x.shape[0] // b
    return x.view(b, ng, nq // ng, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, nq * d)
