"""Causal attention with a sliding window and/or a sink logit per head, from a kernel that
returns the log-sum-exp, keeping no probabilities for backward (the SDPA-like path of
CoreAttention when softmax_type or window_size asks for them).

A sink z (gpt-oss, Megatron's softmax_type "off-by-one" with z = 0 or "learnable") is a
key with logit z and value 0: with o = softmax(S) v over the real keys and
lse = logsumexp(S), the output with the sink is o * exp(lse) / (exp(lse) + exp(z)) =
o * sigmoid(lse - z), and its log-sum-exp is logaddexp(lse, z). Backward (block_math.py's
formulas) needs only the final output and log-sum-exp: with them the probabilities
exp(S - lse') are those of the softmax with the sink, delta = rowsum(do * o') is
unchanged by a value-0 key, and dz = -sum over rows of exp(z - lse') delta.

A window (left, 0): query i sees keys i - left .. i. Queries go by blocks of `block`
positions; block [lo, hi) reads only keys [max(0, lo - left), hi) with a bias [c, keys]
of 0 / -inf marking the band, so work and memory grow with s x (left + block), not s^2.
Without a window on a CPU, one call of the causal flash kernel covers the sequence; on
other devices the blocks' scores are fp32 matmuls (block_math.py), a block at a time.

Shapes: q [s, b, nq, d], k and v [s, b, ng, d] (grouped-query attention: each group's
qg = nq / ng query heads adjacent), sink [nq] or None; the output [s, b, nq * d].
Inside, q is [B, qg, s, d] and k, v [B, s, d] with B = b x ng (block_math.py).
"""

from __future__ import annotations

import functools

import torch

from mp_layers.context_parallel.block_math import (
    block_backward,
    block_forward,
    heads_first,
    sink_per_row,
)

__all__ = ["BAND_BLOCK", "band_bias", "banded_attention"]

BAND_BLOCK = 256
"""Query positions per block with a window (or on a device without the CPU flash kernel)."""


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    block: int = BAND_BLOCK,
) -> torch.Tensor:
    """Causal attention, each query over at most `window` earlier keys besides its own
    (None: all), with a sink logit per query head (None: none)."""
    nq = q.shape[2]
    if nq % k.shape[2]:
        raise ValueError(f"{nq} query heads cannot share {k.shape[2]} key/value heads")
    if sink is not None and sink.shape != (nq,):
        raise ValueError(f"a sink per query head ({nq}) expected, got {tuple(sink.shape)}")
    return _BandedAttention.apply(q, k, v, sink, scale, window, block)


def _blocks(s: int, window: int | None, block: int, device: torch.device):
    """(lo, hi, first key, bias or None) per query block; one causal block without a window
    on a CPU."""
    if window is None and device.type == "cpu":
        yield 0, s, 0, None
        return
    for lo in range(0, s, block):
        hi = min(lo + block, s)
        first = 0 if window is None else max(0, lo - window)
        yield lo, hi, first, (first, window)


class _BandedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, scale: float, window: int | None, block: int):
        s, b, nq, d = q.shape
        ng = k.shape[2]
        qg = nq // ng
        rows = q.reshape(s, b, ng, qg, d).permute(1, 2, 3, 0, 4).contiguous()
        rows = rows.view(b * ng, qg, s, d)
        keys, values = heads_first(k), heads_first(v)
        out = torch.empty(rows.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows.shape[:-1], dtype=torch.float32, device=q.device)
        plan = list(_blocks(s, window, block, q.device))
        for lo, hi, first, band in plan:
            bias = None if band is None else band_bias(lo, hi, first, window, q.dtype, q.device)
            out[:, :, lo:hi], lse[:, :, lo:hi] = block_forward(
                rows[:, :, lo:hi], keys[:, first:hi], values[:, first:hi], band is None,
                scale, bias,
            )  # fmt: skip
        if sink is not None:
            z = sink_per_row(sink, b, ng, qg)  # [B, qg, 1]
            merged = torch.logaddexp(lse, z)
            out.mul_(torch.exp(lse - merged).unsqueeze(-1))
            lse = merged
        ctx.save_for_backward(rows, keys, values, out, lse, sink)
        ctx.plan, ctx.scale, ctx.window, ctx.shape = plan, scale, window, (s, b, nq, d, ng)
        return out.to(q.dtype).view(b, ng, qg, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, nq * d)

    @staticmethod
    def backward(ctx, grad_out):
        rows, keys, values, out, lse, sink = ctx.saved_tensors
        s, b, nq, d, ng = ctx.shape
        qg = nq // ng
        dout = grad_out.reshape(s, b, ng, qg, d).permute(1, 2, 3, 0, 4).reshape(rows.shape)
        dq = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        dk = torch.zeros(keys.shape, dtype=torch.float32, device=rows.device)
        dv = torch.zeros(keys.shape, dtype=torch.float32, device=rows.device)
        for lo, hi, first, band in ctx.plan:
            bias = None
            if band is not None:
                bias = band_bias(lo, hi, first, ctx.window, rows.dtype, rows.device)
            dq[:, :, lo:hi], dk_, dv_ = block_backward(
                rows[:, :, lo:hi], keys[:, first:hi], values[:, first:hi], dout[:, :, lo:hi],
                out[:, :, lo:hi], lse[:, :, lo:hi], band is None, ctx.scale, bias,
            )  # fmt: skip
            dk[:, first:hi] += dk_
            dv[:, first:hi] += dv_
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out).sum(dim=-1)  # [B, qg, s]
            p_sink = torch.exp(sink_per_row(sink, b, ng, qg) - lse)
            dsink = -(p_sink * delta).view(b, ng, qg, s).sum(dim=(0, 3)).reshape(nq)
            dsink = dsink.to(sink.dtype)
        dq = dq.to(rows.dtype).view(b, ng, qg, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, nq, d)
        dk, dv = (t.to(keys.dtype).view(b, ng, s, d).permute(2, 0, 1, 3) for t in (dk, dv))
        return dq, dk, dv, dsink, None, None, None


@functools.lru_cache(maxsize=64)
def band_bias(
    lo: int, hi: int, first: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[hi - lo, hi - first]: 0 where query lo + i sees key first + j (j <= i, and at most
    `window` positions back), -inf elsewhere."""
    queries = torch.arange(lo, hi, device=device)[:, None]
    keys = torch.arange(first, hi, device=device)[None, :]
    masked = keys > queries
    if window is not None:
        masked |= keys < queries - window
    return torch.zeros(masked.shape, dtype=dtype, device=device).masked_fill_(masked, -torch.inf)
