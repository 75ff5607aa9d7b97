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

Shapes: q [s, b, ng * qg, d] with each group's qg heads adjacent, k and v
[s, b, ng, d], sink [ng * qg]; the output is [s, b, ng * qg * d]. The probabilities stay alive
for backward: b * heads * s * (s + block) / 2 elements per layer
(`saved_probability_bytes`), which is why `CoreAttention` picks this only for
short sequences (docs/layers.md has the measurements behind its choice).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mp_layers.transformer.banded_attention import band_bias
from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker

__all__ = ["DEFAULT_BLOCK", "blocked_attention", "saved_probability_bytes"]

DEFAULT_BLOCK = 256
"""Query positions per block: 2 blocks at s = 512, 4 at 1024 (the fastest measured)."""


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
) -> torch.Tensor:
    """attention_mask: [b or 1, 1, s, s] bool, True = masked; None = causal. window: the
    earlier keys each query sees besides its own (None: all). sink: [nq] logits.

    With an explicit mask every block sees all s keys (the mask may allow any
    of them); a row the mask leaves no key gives 0, as torch's SDPA does.
    Dropout on the probabilities draws from the tracker's tensor-parallel
    stream, block by block in order, so a replay with the same tracker state
    draws the same masks.
    """
    s, b, nq, d = q.shape
    ng = k.shape[2]
    qg = nq // ng
    rows = q.reshape(s, b, ng, qg, d).permute(1, 2, 3, 0, 4)  # [b, ng, qg, s, d]
    keys = k.permute(1, 2, 0, 3).reshape(b * ng, s, d)
    values = v.permute(1, 2, 0, 3).reshape(b * ng, s, d)
    if sink is not None:  # the sink as a key (module docstring); channels d + 1
        channel = (sink.to(q.dtype) / scale).view(1, ng, qg, 1, 1).expand(b, ng, qg, s, 1)
        rows = torch.cat([rows, channel], dim=-1)
        keys = F.pad(keys, (0, 1))
        sink_key = F.pad(keys.new_ones(b * ng, 1, 1), (d, 0))
        no_value = values.new_zeros(b * ng, 1, d)
    width = rows.shape[-1]
    # Keys transposed once per layer ([b * ng, d, s]): a block's [d, keys] is then a view
    # whose rows are contiguous, which the matmul reads without a copy of its own per block
    # (with the sink each block joins its sink key anyway).
    keys_t = keys.transpose(1, 2).contiguous() if sink is None else None
    outputs = []
    for lo in range(0, s, block):
        hi = min(lo + block, s)
        c = hi - lo
        keep = None  # 0 for rows that may see no key at all
        if attention_mask is None:
            first = 0 if window is None else max(0, lo - window)
            bias = _causal_bias(lo, hi, first, window, qg, q.dtype, q.device, sink is not None)
            bias = bias.expand(b * ng, *bias.shape)
            seen = slice(first, hi)
        else:
            seen = slice(0, s)
            masked = attention_mask[:, 0, lo:hi]
            if window is not None:
                masked = masked | _outside_window(lo, hi, s, window, q.device)
            dead = masked.all(dim=-1, keepdim=True)
            if dead.any():
                # Softmax over no key is 0 / 0: such rows see every key, then get probability
                # 0 everywhere (output 0, as SDPA gives, and finite gradients).
                masked = masked & ~dead
                keep = _per_head(~dead, b, ng, qg).to(q.dtype)
            bias = _per_head(_additive(masked, q.dtype), b, ng, qg)
            if sink is not None:
                bias = F.pad(bias, (0, 1))
        block_rows = rows[:, :, :, lo:hi].reshape(b * ng, qg * c, width)
        block_values = values[:, seen]
        if sink is None:
            block_keys_t = keys_t[:, :, seen]
        else:
            block_keys_t = torch.cat([keys[:, seen], sink_key], dim=1).transpose(1, 2)
            block_values = torch.cat([block_values, no_value], dim=1)
        scores = torch.baddbmm(bias, block_rows, block_keys_t, alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        if keep is not None:
            probs = probs * keep
        if dropout > 0:
            with rng_tracker.fork(TENSOR_PARALLEL_RNG):
                probs = F.dropout(probs, dropout)
        out = torch.bmm(probs, block_values)  # [b * ng, qg * c, d]
        outputs.append(out.view(b, ng, qg, c, d).permute(3, 0, 1, 2, 4))
    return torch.cat(outputs).view(s, b, nq * d)


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
