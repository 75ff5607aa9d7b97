"""Which part of a sequence each context-parallel rank holds, and which attention blocks
it computes: the plan, computed without any process.

Megatron's load balancing for causal attention: the sequence is cut into 2 x cp equal
chunks and CP rank r keeps chunks r and 2cp-1-r, so every rank holds one early and one
late chunk and does the same attention work. For cp = 2 (chunks of s/4):

    sequence   | c0 | c1 | c2 | c3 |
    rank 0       c0             c3
    rank 1            c1   c2

A rank's local sequence is its two chunks side by side; position ids travel with the
tokens, so rotary embeddings see the true positions.

Attention between a query chunk a and a key/value chunk c (both global chunk indices):
c < a: every key precedes every query ("full"); c == a: the diagonal ("causal");
c > a: every key follows every query, nothing to compute ("skip").
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

__all__ = [
    "Block",
    "attention_blocks",
    "local_chunks",
    "local_positions",
    "shard_sequence",
]

BlockKind = Literal["full", "causal"]


class Block(NamedTuple):
    """One piece of attention work: query half `q_half` (0 or 1 of this rank's two chunks)
    against key/value half `kv_half` of the chunks being attended to."""

    q_half: int
    kv_half: int
    kind: BlockKind


def local_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices CP rank `cp_rank` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of `tensor` along `dim` (the sequence): its two chunks,
    concatenated. The sequence length must be divisible by 2 x cp_size."""
    if cp_size == 1:
        return tensor
    s = tensor.shape[dim]
    if s % (2 * cp_size):
        raise ValueError(
            f"sequence length {s} is not divisible by 2 x context_parallel_size={cp_size}"
        )
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = local_chunks(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def local_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[seq_length / cp_size] the global positions of this rank's tokens, in local order."""
    return shard_sequence(torch.arange(seq_length), cp_size, cp_rank, dim=0)


def attention_blocks(q_chunks: tuple[int, int], kv_chunks: tuple[int, int]) -> list[Block]:
    """The blocks to compute between this rank's query chunks and two key/value chunks
    (global indices), skipping those in which every key follows every query."""
    blocks = []
    for q_half, a in enumerate(q_chunks):
        for kv_half, c in enumerate(kv_chunks):
            if c < a:
                blocks.append(Block(q_half, kv_half, "full"))
            elif c == a:
                blocks.append(Block(q_half, kv_half, "causal"))
    return blocks
