"""Attention over one block of queries and keys, with the log-sum-exp, and the merge of
blocks by their log-sum-exp (the online softmax of Milakov & Gimelshein, 2018, as used
by flash attention and ring attention).

For scores S = scale q k^T over a block of keys, lse = log sum_j exp(S_j) and the
block's output o = softmax(S) v. Two blocks of keys for the same queries merge as
lse = logaddexp(lse_1, lse_2), o = o_1 exp(lse_1 - lse) + o_2 exp(lse_2 - lse): the
softmax over both. Backward from the final o and lse (Dao et al., 2022): with
P = exp(S - lse) the probabilities over all keys restricted to the block,
dv = P^T do, dP = do v^T, dS = P (dP - delta), delta = rowsum(do o), dq = scale dS k,
dk = scale dS^T q: each block's gradients need only the block and the row statistics.

Two kernels compute a block. On a CPU, torch's flash-attention kernel (the one behind
scaled_dot_product_attention there), which returns the log-sum-exp and whose backward
takes the final o and lse: the scores never leave its tiles. Elsewhere, matmuls over the
block's fp32 scores, written out whole. On the 2-core CPU of docs/benchmarks.md
(bf16, 8 heads in 4 groups of 64 channels, blocks of 2048 x 2048 keys, one thread) the
flash kernel is about 2.8 times faster on full blocks and 5 times on diagonal ones,
forward and backward alike.

Shapes (grouped-query attention without repeating k and v): q [B, qg, c, d] where B is
batch x key/value heads and qg the query heads sharing each; k, v [B, c_k, d]; o [B,
qg, c, d]; lse and delta [B, qg, c]. Outputs, lse and gradients are fp32. A "causal"
block lies on the diagonal (query i sees keys 0..i, c == c_k); a "full" one sees every
key. A `bias` [c, c_k] (0 or -inf, q's dtype; every row with a 0), or [B, 1, c, c_k], is
added to the scores of a block that is not "causal": a band of a sliding window
(banded_attention.py), the pairs within one document of packed sequences (ring
attention; there a row may have no 0, and the caller sets its output to 0 and its lse
to -inf).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["block_backward", "block_forward", "heads_first", "merge_into", "sink_per_row"]


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """Keys or values [s, b, ng, d] -> [b * ng, s, d], the layout of `k` and `v` here
    (a copy unless b * ng is 1)."""
    s, b, ng, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(b * ng, s, d)


def sink_per_row(sink: torch.Tensor, b: int, ng: int, qg: int) -> torch.Tensor:
    """A sink logit per head [nq] -> [B, qg, 1] fp32: each row's head's (B = b x ng)."""
    return sink.float().view(1, ng, qg).expand(b, ng, qg).reshape(b * ng, qg, 1)


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, bias: torch.Tensor | None
) -> torch.Tensor:
    """[B, qg, c, c_k] fp32 scores, -inf above the diagonal of a causal block."""
    b, qg, c, d = q.shape
    scores = torch.bmm(q.reshape(b, qg * c, d), k.transpose(1, 2)).float().mul_(scale)
    scores = scores.view(b, qg, c, k.shape[1])
    if causal:
        scores.masked_fill_(_above_diagonal(c, q.device), -torch.inf)
    if bias is not None:
        scores.add_(bias)
    return scores


@functools.lru_cache(maxsize=16)
def _above_diagonal(c: int, device: torch.device) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


def _flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu"


def _per_query_head(x: torch.Tensor, qg: int) -> torch.Tensor:
    """[B, c_k, d] -> [B, qg, c_k, d], the same keys (or values) for each query head (a
    view: the flash kernel reads them in place)."""
    return x.unsqueeze(1).expand(-1, qg, -1, -1)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output [B, qg, c, d] and log-sum-exp [B, qg, c], both fp32. keep [B, qg,
    c, c_k] fp32 (attention dropout: 0 for a dropped probability, 1 / (1 - p) for a kept
    one) multiplies the probabilities before they weigh the values; the log-sum-exp is
    the undropped scores'."""
    if _flash(q) and keep is None:
        qg = q.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _per_query_head(k, qg), _per_query_head(v, qg), 0.0, causal, attn_mask=bias,
            scale=scale,
        )  # fmt: skip
        return out.float(), lse.float()
    scores = _scores(q, k, causal, scale, bias)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    if keep is not None:
        probs.mul_(keep)
    b, qg, c, ck = probs.shape
    out = torch.bmm(probs.view(b, qg * c, ck).to(v.dtype), v).float()
    return out.view(b, qg, c, -1), lse


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """out, lse (views of the running result; lse may be -inf where nothing was seen yet)
    become the softmax over their keys and the block's."""
    merged = torch.logaddexp(lse, block_lse)
    # Rows that saw no key on either side stay -inf with a zero output (packed documents
    # leave rows of a block without keys), instead of exp(-inf - -inf) = nan.
    base = merged.masked_fill(torch.isneginf(merged), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(merged)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, qg, c, d], dk and dv [B, c_k, d] (fp32) of this block, from the final output
    `out` [B, qg, c, d] and lse [B, qg, c] (fp32) of its query rows: the attention over
    every block, not this block's alone; keep: block_forward's dropout multipliers.
    With dropout, dP = keep (dO V^T) and delta = rowsum(dO O) of the dropped output
    (Dao, 2023)."""
    b, qg, c, d = q.shape
    if _flash(q) and keep is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, _per_query_head(k, qg), _per_query_head(v, qg),
            out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32),
            0.0, causal, attn_mask=bias, scale=scale,
        )  # fmt: skip
        return dq.float(), dk.float().sum(1), dv.float().sum(1)
    ck = k.shape[1]
    delta = (dout.float() * out).sum(dim=-1)  # [B, qg, c]
    probs = _scores(q, k, causal, scale, bias).sub_(lse.unsqueeze(-1)).exp_()  # [B, qg, c, ck]
    kept = probs if keep is None else probs * keep
    rows = kept.view(b, qg * c, ck)
    dout_rows = dout.reshape(b, qg * c, d).float()
    dv = torch.bmm(rows.transpose(1, 2), dout_rows)
    dprobs = torch.bmm(dout_rows, v.float().transpose(1, 2)).view(b, qg, c, ck)
    if keep is not None:
        dprobs.mul_(keep)
    dscores = probs.mul_(dprobs.sub_(delta.unsqueeze(-1))).mul_(scale).view(b, qg * c, ck)
    dq = torch.bmm(dscores, k.float()).view(b, qg, c, d)
    dk = torch.bmm(dscores.transpose(1, 2), q.reshape(b, qg * c, d).float())
    return dq, dk, dv
