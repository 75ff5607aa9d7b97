"""Attention with the probabilities written out, one block of query positions at a time.

softmax(q k^T * scale) v as a matmul, a softmax over the materialized scores and a
second matmul, like Megatron's local (unfused) DotProductAttention, but by blocks
of `block` query positions. Under the causal mask the block [lo, hi) sees only the
keys [0, hi), so the score blocks above the diagonal are never computed: n blocks
do (n + 1) / 2n of the full square's work and hold as much of it in memory.

Grouped-query attention without repeating k and v: the qg query heads that share
a key/value head are stacked along the rows, so one [qg * c, d] x [d, keys]
matmul serves the whole group, and backward sums the group's key and value
gradients inside the matmuls.

A sliding window (left, 0) narrows each block's keys to [lo - left, hi) besides the
causal mask (with an explicit mask, it masks the keys more than `window` positions back).
A sink logit z per head (softmax_type "off-by-one" or "learnable") is one more key with
value 0 and score z: each query row gets one more channel z / scale, the keys a channel
0 and the sink key (0, ..., 0, 1), so the one matmul gives its column with the scores
without copying the scores (a concatenated score column was 1.05 times slower in fp32
and 1.5 times in bf16, s 2048 and 4096, forward and backward, on the loaded 2-core CPU
of docs/layers.md).

Backward is the blocks' own (not autograd's through the slices, which would give each
block a zero-filled gradient of the whole q, k and v): each block's gradients go into the
slices of one dq, dk and dv, and a block's queries are sliced again rather than kept.
Matmuls over a block's slice of the keys run as b * ng two-dimensional ones, which read
the slice's strided rows in place, where one batched matmul would copy the slice first
(1.07x faster forward and backward at s 2048, 1.2x with sinks, bf16, one thread).

Shapes: q [s, b, ng * qg, d] with each group's qg heads adjacent, k [s, b, ng, d], v
[s, b, ng, dv] (dv may differ from d), sink [ng * qg]; the output is [s, b, ng * qg * dv].
The probabilities stay alive for backward: b * heads * s * (s + block) / 2 elements per layer
(`saved_probability_bytes`), which is why `CoreAttention` picks this only for
short sequences (docs/layers.md has the measurements behind its choice).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mp_layers.context_parallel.block_math import heads_first
from mp_layers.transformer.banded_attention import band_bias
from mp_layers.transformer.eager import eager_when_compiled
from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker

__all__ = ["DEFAULT_BLOCK", "blocked_attention", "saved_probability_bytes"]

DEFAULT_BLOCK = 256
"""Query positions per block: 2 blocks at s = 512, 4 at 1024 (the fastest measured)."""


# Eager inside a compiled layer: inductor's code for these blocks and their own backward
# was slower than this eager code on the 2-core CPU (docs/training.md).
@eager_when_compiled
def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scale: float,
    dropout: float = 0.0,
    rng_tracker: RNGStatesTracker | None = None,
    block: int = DEFAULT_BLOCK,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    score_divisor: int | None = None,
) -> torch.Tensor:
    """attention_mask: [b or 1, 1, s, s] bool, True = masked; None = causal. window: the
    earlier keys each query sees besides its own (None: all). sink: [nq] logits.
    score_divisor: Megatron-LM's query-key layer scaling (the layer's number): the scores
    come out of their matmul, in the input precision, divided by it, and are multiplied
    back in fp32 before the softmax; the same attention, with fp16 scores in range.

    With an explicit mask every block sees all s keys (the mask may allow any
    of them); a row the mask leaves no key gives 0, as torch's SDPA does.
    Dropout on the probabilities draws from the tracker's tensor-parallel
    stream, block by block in order, so a replay with the same tracker state
    draws the same masks.
    """
    plan = _Plan(q, k, v, attention_mask, scale, dropout, rng_tracker, block, window, sink)
    plan.score_divisor = score_divisor
    inputs = (q, k, v) if sink is None else (q, k, v, sink)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _BlockedAttention.apply(plan, q, k, v, sink)
    return _forward(plan, q, k, v, sink, keep_for_backward=False)[0]


class _Plan:
    """What forward and backward share: the shapes, and each block's keys and bias."""

    def __init__(self, q, k, v, attention_mask, scale, dropout, rng_tracker, block, window, sink):
        self.s, self.b, self.nq, self.d = q.shape
        self.ng, self.dv = k.shape[2], v.shape[3]
        self.qg = self.nq // self.ng
        self.mask, self.window, self.block = attention_mask, window, block
        self.scale, self.dropout, self.rng_tracker = scale, dropout, rng_tracker
        self.sink = sink is not None
        self.sink_dtype = None if sink is None else sink.dtype
        self.dtype, self.device = q.dtype, q.device
        self.score_divisor: int | None = None

    def blocks(self):
        """(lo, hi, the keys seen, bias [b * ng, qg * c, keys (+ 1 with a sink)], keep) per
        block of queries; keep: [b * ng, qg * c, 1] 0 for the rows that see no key, or None."""
        b, ng, qg, s, window = self.b, self.ng, self.qg, self.s, self.window
        for lo in range(0, s, self.block):
            hi = min(lo + self.block, s)
            keep = None
            if self.mask is None:
                first = 0 if window is None else max(0, lo - window)
                bias = _causal_bias(lo, hi, first, window, qg, self.dtype, self.device,
                                    self.sink)  # fmt: skip
                yield lo, hi, slice(first, hi), bias.expand(b * ng, *bias.shape), None
                continue
            masked = self.mask[:, 0, lo:hi]
            if window is not None:
                masked = masked | _outside_window(lo, hi, s, window, self.device)
            dead = masked.all(dim=-1, keepdim=True)
            if dead.any():
                # Softmax over no key is 0 / 0: such rows see every key, then get probability
                # 0 everywhere (output 0, as SDPA gives, and finite gradients).
                masked = masked & ~dead
                keep = _per_head(~dead, b, ng, qg).to(self.dtype)
            bias = _per_head(_additive(masked, self.dtype), b, ng, qg)
            yield lo, hi, slice(0, s), F.pad(bias, (0, 1)) if self.sink else bias, keep

    def rows(self, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """[b * ng, qg * c, d]: the block's queries, each group's heads stacked (a copy)."""
        by_group = q.view(self.s, self.b, self.ng, self.qg, -1)[lo:hi].permute(1, 2, 3, 0, 4)
        return by_group.reshape(self.b * self.ng, self.qg * (hi - lo), -1)


def _forward(plan: _Plan, q, k, v, sink, keep_for_backward: bool):
    """(output [s, b, nq * dv], what backward needs: the keys as [b * ng, d, s] (a view of
    [b * ng, s, d] with a sink), the values [b * ng, s, dv], and per block the
    probabilities after `keep` and the dropout mask or None)."""
    b, ng, qg, d, dv, scale = plan.b, plan.ng, plan.qg, plan.d, plan.dv, plan.scale
    values = heads_first(v)
    if sink is not None:  # the sink as a key (module docstring); channels d + 1
        keys = heads_first(k)
        keys_t = keys.transpose(1, 2)  # a view: backward reads the keys by rows
        padded_keys = F.pad(keys, (0, 1))
        sink_key = F.pad(keys.new_ones(b * ng, 1, 1), (d, 0))
        no_value = values.new_zeros(b * ng, 1, dv)
        channel = (sink.to(q.dtype) / scale).view(1, ng, qg, 1, 1)
    else:
        # The keys transposed once per layer ([b * ng, d, s]): a block's [d, keys] is then
        # a matrix of contiguous rows for each of the b * ng matmuls (_bmm).
        keys_t = k.permute(1, 2, 3, 0).reshape(b * ng, d, plan.s)
    out = q.new_empty(plan.s, b, ng, qg, dv)
    saved = []
    for lo, hi, seen, bias, keep in plan.blocks():
        c = hi - lo
        rows = plan.rows(q, lo, hi)
        block_values = values[:, seen]
        if sink is None:
            block_keys_t = keys_t[:, :, seen]
        else:
            rows = torch.cat([rows.view(b, ng, qg, c, d), channel.expand(b, ng, qg, c, 1)],
                             dim=-1).view(b * ng, qg * c, d + 1)  # fmt: skip
            block_keys_t = torch.cat([padded_keys[:, seen], sink_key], dim=1).transpose(1, 2)
            block_values = torch.cat([block_values, no_value], dim=1)
        probs = _probabilities(plan, rows, block_keys_t, bias)
        if keep is not None:
            probs.mul_(keep)
        dropped = None
        if plan.dropout > 0:
            with plan.rng_tracker.fork(TENSOR_PARALLEL_RNG):
                dropped = torch.empty_like(probs).bernoulli_(1 - plan.dropout)
        weights = probs if dropped is None else probs * dropped / (1 - plan.dropout)
        block_out = _bmm(weights, block_values)  # [b * ng, qg * c, dv]
        out[lo:hi] = block_out.view(b, ng, qg, c, dv).permute(3, 0, 1, 2, 4)
        if keep_for_backward:
            saved.append((probs, None if dropped is None else dropped.bool()))
    return out.view(plan.s, b, plan.nq * dv), (keys_t, values, saved)


class _BlockedAttention(torch.autograd.Function):
    """The blocks' own backward: each block's gradients go straight into the slices of
    one dq, dk and dv (autograd would zero-fill a whole-size gradient per block slice)."""

    @staticmethod
    def forward(ctx, plan: _Plan, q, k, v, sink):
        out, (keys_t, values, saved) = _forward(plan, q, k, v, sink, keep_for_backward=True)
        ctx.plan, ctx.probs = plan, saved
        ctx.save_for_backward(q, keys_t, values)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        q, keys_t, values = ctx.saved_tensors
        s, b, ng, qg, d, d_v = plan.s, plan.b, plan.ng, plan.qg, plan.d, plan.dv
        grad_out = grad_out.view(s, b, ng, qg, d_v)
        dq = q.new_empty(s, b, ng, qg, d)
        dk, dv = values.new_zeros(b * ng, s, d), torch.zeros_like(values)
        dsink = torch.zeros(ng, qg, dtype=torch.float32, device=q.device) if plan.sink else None
        for (lo, hi, seen, _, _), (probs, dropped) in zip(plan.blocks(), ctx.probs, strict=True):
            c = hi - lo
            grad_rows = grad_out[lo:hi].permute(1, 2, 3, 0, 4).reshape(b * ng, qg * c, d_v)
            weights = probs
            if dropped is not None:
                weights = probs * dropped / (1 - plan.dropout)
            if plan.sink:  # the sink key: value 0, so no gradient of its own to dv
                weights = weights[:, :, :-1]
            _bmm_add_(dv[:, seen], weights.transpose(1, 2), grad_rows)
            grad_weights = _bmm(grad_rows, values[:, seen].transpose(1, 2))
            if plan.sink:
                grad_weights = F.pad(grad_weights, (0, 1))  # the sink's value is 0
            if dropped is not None:
                grad_weights.mul_(dropped).div_(1 - plan.dropout)
            # probs are 0 on the rows `keep` emptied, so their score gradients are 0
            grad_scores = torch._softmax_backward_data(grad_weights, probs, -1, probs.dtype)
            if plan.sink:
                sink_column = grad_scores[:, :, -1].float().view(b, ng, qg, c)
                dsink += sink_column.sum(dim=(0, 3))
                grad_scores = grad_scores[:, :, :-1]
            block_dq = _bmm(grad_scores, keys_t[:, :, seen].transpose(1, 2)).mul_(plan.scale)
            dq[lo:hi] = block_dq.view(b, ng, qg, c, d).permute(3, 0, 1, 2, 4)
            rows = plan.rows(q, lo, hi)
            _bmm_add_(dk[:, seen], grad_scores.transpose(1, 2), rows, alpha=plan.scale)
        dq = dq.view(s, b, plan.nq, d)
        dk = dk.view(b, ng, s, d).permute(2, 0, 1, 3)
        dv = dv.view(b, ng, s, d_v).permute(2, 0, 1, 3)
        dsink = None if dsink is None else dsink.flatten().to(plan.sink_dtype)
        return None, dq, dk, dv, dsink


def _probabilities(plan: _Plan, rows, keys_t, bias) -> torch.Tensor:
    """softmax(scale rows @ keys_t + bias) in the input dtype; with a score divisor L the
    matmul gives the scores divided by L and the softmax takes them back times L in fp32
    (Megatron-LM's query-key layer scaling, its softmax in fp32)."""
    divisor = plan.score_divisor
    if not divisor or divisor == 1:
        return _bmm(rows, keys_t, bias=bias, alpha=plan.scale).softmax(dim=-1)
    scores = _bmm(rows, keys_t, bias=bias, alpha=plan.scale / divisor)
    return scores.float().mul_(divisor).softmax(dim=-1).to(scores.dtype)


def _whole(t: torch.Tensor) -> bool:
    """Whether torch's batched matmuls read t ([B, m, n]) without copying it first: a
    contiguous tensor or the transpose of one (a block's slice of the keys is neither)."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


def _bmm(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
         alpha: float = 1.0) -> torch.Tensor:  # fmt: skip
    """[bias +] alpha a @ b for a [B, m, k], b [B, k, n]: one batched matmul where both are
    whole (_whole), else B matmuls, which read each matrix's strided rows as they are
    (a batched one would copy them first, block after block)."""
    if _whole(a) and _whole(b):
        return torch.bmm(a, b) if bias is None else torch.baddbmm(bias, a, b, alpha=alpha)
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for i in range(a.shape[0]):
        if bias is None:
            torch.mm(a[i], b[i], out=out[i])
        else:
            torch.addmm(bias[i], a[i], b[i], alpha=alpha, out=out[i])
    return out


def _bmm_add_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """out += alpha a @ b in place, out a slice [B, keys, d] of a whole [B, s, d]."""
    if out.is_contiguous() and _whole(a) and _whole(b):
        out.baddbmm_(a, b, alpha=alpha)
        return
    for i in range(out.shape[0]):
        out[i].addmm_(a[i], b[i], alpha=alpha)


def saved_probability_bytes(
    s: int,
    b: int,
    heads: int,
    element_size: int,
    *,
    causal: bool = True,
    block: int = DEFAULT_BLOCK,
) -> int:
    """Bytes of probabilities one layer keeps for backward: the blocks at and below
    the diagonal under the causal mask, the whole square with an explicit one."""
    if not causal:
        return b * heads * s * s * element_size
    n = -(-s // block)
    c = min(block, s)
    # Blocks of c rows seeing c, 2c, ..., n c keys (the last may be shorter).
    elements = sum(min(c, s - i * c) * min((i + 1) * c, s) for i in range(n))
    return b * heads * elements * element_size


@functools.lru_cache(maxsize=64)
def _causal_bias(
    lo: int,
    hi: int,
    first: int,
    window: int | None,
    qg: int,
    dtype: torch.dtype,
    device: torch.device,
    sink: bool = False,
) -> torch.Tensor:
    """[qg * (hi - lo), hi - first] over keys first..hi-1: 0 where the query position sees
    the key (key <= query, and at most `window` back), -inf elsewhere; qg copies of the
    rows, one per query head of a group; with `sink`, a last column of 0 (the sink key)."""
    bias = band_bias(lo, hi, first, window, dtype, device).repeat(qg, 1)
    return F.pad(bias, (0, 1)) if sink else bias


def _outside_window(lo: int, hi: int, s: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, hi - lo, s] bool: True for keys more than `window` positions before the query."""
    queries = torch.arange(lo, hi, device=device)[:, None]
    return (torch.arange(s, device=device)[None, :] < queries - window)[None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = masked) -> 0 / -inf."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -torch.inf)


def _per_head(rows: torch.Tensor, b: int, ng: int, qg: int) -> torch.Tensor:
    """[b or 1, c, n] per sample -> [b * ng, qg * c, n]: the same rows for every head."""
    c, n = rows.shape[1:]
    return rows[:, None, None].expand(b, ng, qg, c, n).reshape(b * ng, qg * c, n)
