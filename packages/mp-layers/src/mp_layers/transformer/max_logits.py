"""The largest attention logit of each head (QK-clip's statistic, mp_layers.config_qk_clip):
q . k x scale over the pairs attention allows (causal, a sliding window, one document, an
explicit mask), computed a block of query rows at a time without gradients, beside the
attention itself (whose kernel, SDPA, does not return it). It costs one more q k^T."""

from __future__ import annotations

import torch

__all__ = ["max_attention_logits"]

_SCORES_PER_BLOCK = 2**22
"""Scores one block of query rows holds at most (16 MiB in fp32)."""


@torch.no_grad()
def max_attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    *,
    attention_mask: torch.Tensor | None = None,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """[nq] fp32: each query head's largest logit. q [s, b, nq, d], k [s, b, ng, d] (query
    heads of a group adjacent); attention_mask [b or 1, 1, s, s] bool (True = masked) or
    None (causal); window: keys more than this many positions back are masked; documents
    [b, s]: a key of another document is masked."""
    s, b, nq, d = q.shape
    ng = k.shape[2]
    per = nq // ng
    keys = k.permute(1, 2, 3, 0).float()  # [b, ng, d, s]
    rows = max(1, min(s, _SCORES_PER_BLOCK // max(1, b * nq * s)))
    best = torch.full((nq,), -torch.inf, device=q.device)
    positions = torch.arange(s, device=q.device)
    for lo in range(0, s, rows):
        hi = min(s, lo + rows)
        block = q[lo:hi].permute(1, 2, 0, 3).float()  # [b, nq, r, d]
        block = block.reshape(b, ng, per * (hi - lo), d)
        scores = (block @ keys).view(b, ng, per, hi - lo, s) * scale
        queries = positions[lo:hi, None]
        if attention_mask is None:
            masked = positions[None, :] > queries  # [r, s]
            if window is not None:
                masked = masked | (positions[None, :] < queries - window)
            masked = masked[None, None, None]
        else:
            masked = attention_mask[:, :, lo:hi][:, None]  # [b or 1, 1, 1, r, s]
            if window is not None:
                masked = masked | (positions[None, :] < queries - window)
        if documents is not None:
            other = documents[:, lo:hi, None] != documents[:, None, :]  # [b, r, s]
            masked = masked | other[:, None, None]
        scores = scores.masked_fill(masked, -torch.inf)
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).reshape(nq))
    return best
