"""Llama 4's chunked attention: a layer attends only within aligned blocks of `chunk`
positions (position p sees positions chunk floor(p / chunk) .. p), as Hugging Face's
attention_chunk_size makes its rotary layers do.

Without a mask, the blocks become batch entries: q, k and v [s, b, heads, d] are padded
to a whole number of blocks and viewed as [chunk, blocks b, heads, d], so the core
attention's causal path (SDPA or blocked, dropout and sinks included) runs unchanged and
no score crosses a block. The padding comes after every real position of the last
block, so no real query attends to it, and its outputs are dropped. An explicit mask
[b or 1, 1, s, T] instead gains the block condition (`block_mask`). A sequence within one
block is attended as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["attend_in_blocks", "block_mask"]


def attend_in_blocks(
    attend: Callable[..., torch.Tensor],
    chunk: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """attend(q, k, v) -> [s, b, heads * dv] (causal core attention) within blocks of
    `chunk` positions; q, k, v [s, b, heads, d] with s > chunk."""
    s, b = q.shape[:2]
    blocks = -(-s // chunk)
    padded = blocks * chunk

    def as_blocks(t: torch.Tensor) -> torch.Tensor:  # [s, b, n, d] -> [chunk, blocks b, n, d]
        t = F.pad(t, (0, 0, 0, 0, 0, 0, 0, padded - s))
        return (
            t.view(blocks, chunk, *t.shape[1:])
            .transpose(0, 1)
            .reshape(chunk, blocks * b, *t.shape[2:])
        )

    out = attend(as_blocks(q), as_blocks(k), as_blocks(v))  # [chunk, blocks b, w]
    out = out.view(chunk, blocks, b, -1).transpose(0, 1).reshape(padded, b, -1)
    return out[:s]


def block_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, chunk: int
) -> torch.Tensor:
    """[b, 1, s, T] bool, True = masked: the keys outside each query's block, given the
    positions of the queries [b, s] and of the keys [b, T]."""
    queries = torch.div(query_positions, chunk, rounding_mode="floor")[:, None, :, None]
    keys = torch.div(key_positions, chunk, rounding_mode="floor")[:, None, None, :]
    return queries != keys
