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
from mp_layers.context_parallel.block_plan import BlockPlan, check_document_chunks
from mp_layers.context_parallel.layout import local_chunks
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
        check_document_chunks(document_chunks, q.shape[1], s // 2)
    if sink is not None and tuple(sink.shape) != (nq,):
        raise ValueError(f"sink of shape {tuple(sink.shape)} for {nq} query heads")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")
    plan = BlockPlan(documents, document_chunks, s // 2, k.shape[2], q.dtype, q.device, window,
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
