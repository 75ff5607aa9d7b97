"""Core attention: softmax(q k^T / sqrt(d)) v, causal, through torch's SDPA.

Shapes: q [s, b, nq, d], k and v [s, b, ng, d] with nq = ng * (heads per
group), the output [s, b, nq * d]. All heads here are this TP rank's. Key and
value heads are shared by the query heads of their group (grouped-query
attention; ng = nq is multi-head attention). Dropout on the attention
probabilities runs inside the tracker's tensor-parallel stream: the heads are
sharded, so each TP rank must draw its own mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mp_state import TENSOR_PARALLEL_RNG, RNGStatesTracker

__all__ = ["CoreAttention"]


class CoreAttention(torch.nn.Module):
    def __init__(self, attention_dropout: float, rng_tracker: RNGStatesTracker | None) -> None:
        super().__init__()
        if attention_dropout > 0 and rng_tracker is None:
            raise ValueError(
                f"attention_dropout={attention_dropout} needs an rng_tracker (mp_state.set_random_"
                "seeds returns one) so that each tensor-parallel rank draws its own masks"
            )
        self.attention_dropout = attention_dropout
        self.rng_tracker = rng_tracker

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """attention_mask: [b or 1, 1, s, s] bool, True = masked; None = causal."""
        s, b, nq, d = q.shape
        if nq % k.shape[2]:
            raise ValueError(f"{nq} query heads cannot share {k.shape[2]} key/value heads")
        # SDPA wants [b, n, s, d]; it shares each key/value head among its group's
        # query heads itself (enable_gqa), without materializing repeated k and v.
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        dropout = self.attention_dropout if self.training else 0.0
        kwargs = {"dropout_p": dropout, "scale": 1.0 / math.sqrt(d), "enable_gqa": nq != k.shape[2]}
        if attention_mask is None:
            kwargs["is_causal"] = True
        else:
            kwargs["attn_mask"] = ~attention_mask
        if dropout > 0:
            with self.rng_tracker.fork(TENSOR_PARALLEL_RNG):
                out = F.scaled_dot_product_attention(q_, k_, v_, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q_, k_, v_, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, nq * d)
