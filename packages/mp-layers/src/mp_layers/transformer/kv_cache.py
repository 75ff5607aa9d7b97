"""The keys and values of the positions a model has seen, for generation one token at a
time (Megatron's inference context).

    cache = KVCache(padding=torch.tensor([2, 0]), max_length=40)   # two prompts, left-padded
    logits = model(prompt_ids, kv_cache=cache)       # prefill: every prompt position
    logits = model(next_ids[:, None], kv_cache=cache)   # then one new position per call

The b sequences share one time axis: prompts of different lengths are padded on the
left, `padding[i]` positions for sequence i, so that every sequence's next token goes
to the same slot. A sequence's positions (for RoPE or learned position embeddings)
count from its first real token; its padding is never attended to. Each layer keeps
its keys and values [max_length, b, key/value heads on this rank, d] (grouped-query
attention caches only the groups' heads; stored [b, heads, max_length, d]), allocated
on first use with the layer's dtype and device. A pipeline stage's model fills the layers it holds.
"""

from __future__ import annotations

import torch

__all__ = ["KEY_BLOCK", "KVCache"]

KEY_BLOCK = 64
"""After the prompts, attention reads the cache's keys in multiples of this many slots
(KVCache.slots_read)."""


class KVCache:
    """Keys and values of b sequences up to `max_length` positions (module docstring)."""

    def __init__(self, padding: torch.Tensor, max_length: int, *, all_logits: bool = False) -> None:
        """padding [b]: each sequence's padding slots on the left. all_logits: the model
        returns the logits of every new position (the prompts' log-probabilities), not
        only of the last."""
        if padding.dim() != 1:
            raise ValueError(
                f"padding must be [b], one count per sequence; got {tuple(padding.shape)}"
            )
        if int(padding.max()) >= max_length:
            raise ValueError(
                f"padding {padding.tolist()} leaves no room in max_length={max_length}"
            )
        self.padding = padding.long()
        self.max_length = max_length
        self.all_logits = all_logits
        self.length = 0
        """Positions filled (the same for every sequence and layer once a forward ends)."""
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def batch_size(self) -> int:
        return self.padding.numel()

    def check_room(self, s: int) -> None:
        if self.length + s > self.max_length:
            raise ValueError(
                f"{s} more positions after {self.length} exceed the cache's "
                f"max_length={self.max_length}"
            )

    def position_ids(self, s: int, device: torch.device | str) -> torch.Tensor:
        """[b, s]: each sequence's positions of the next s slots (0 at its first real token;
        its padding slots get 0 too, and are never attended to)."""
        slots = torch.arange(self.length, self.length + s, device=device)
        return (slots[None, :] - self.padding.to(device)[:, None]).clamp(min=0)

    def slots_read(self, s: int) -> int:
        """T, the key slots attention reads for the next s positions: length + s for the
        prompts (the first forward), after them length + s rounded up to KEY_BLOCK
        slots (at most max_length). The slots past length + s hold zeros and are masked.
        Why: a CPU bf16 matmul (oneDNN) builds a kernel for each new shape and keeps 1,024
        of them; a key count growing by one each step would build two a step per layer
        shape and, past 512 steps, evict each before its reuse (about 1 ms a step at
        batch 1, ci/bench/bench_generate.py)."""
        total = self.length + s
        if self.length == 0:
            return total
        return min(-(-total // KEY_BLOCK) * KEY_BLOCK, self.max_length)

    def attention_mask(self, s: int, device: torch.device | str) -> torch.Tensor:
        """[b, 1, s, T] bool (T = slots_read(s)), True = masked: the next s slots attend
        causally to every filled slot but padding. A padding slot attends to itself alone
        (a row with nothing to attend to would give NaN, which would reach the real
        positions through the values)."""
        total = self.length + s
        queries = torch.arange(self.length, total, device=device)[:, None]  # [s, 1]
        keys = torch.arange(self.slots_read(s), device=device)[None, :]  # [1, T]
        padded = keys[None] < self.padding.to(device)[:, None, None]  # [b, 1, T]
        masked = (keys > queries)[None] | (padded & (keys != queries)[None])  # [b, s, T]
        return masked[:, None]

    def window_start(self, window: int) -> int:
        """The first key slot a layer with a sliding window of `window` earlier keys reads
        for the next positions: every slot before length - window is out of every new
        query's window. Rounded down to KEY_BLOCK slots, so the slots read keep few shapes
        (slots_read); 0 for the prompts."""
        return max(0, self.length - window) // KEY_BLOCK * KEY_BLOCK

    def outside_window(self, s: int, window: int, device: torch.device | str) -> torch.Tensor:
        """[1, 1, s, T] bool (T = slots_read(s)), True for the keys more than `window`
        positions before each of the next s slots (a layer's sliding window; the
        sequences' padding shifts queries and keys alike)."""
        queries = torch.arange(self.length, self.length + s, device=device)[:, None]
        keys = torch.arange(self.slots_read(s), device=device)[None, :]
        return (keys < queries - window)[None, None]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new positions' keys and values [s, b, heads, d] of `layer` (its
        number in the whole model) after the filled ones; returns those of the slots
        attention reads, [slots_read(s), b, heads, d]."""
        s = k.shape[0]
        if k.shape[1] != self.batch_size:
            raise ValueError(f"keys of {k.shape[1]} sequences in a cache of {self.batch_size}")
        if layer not in self._layers:
            # Stored [b, heads, max_length, d], handed out as [T, b, heads, d] views: each
            # head's positions are rows of one matrix, as attention's matmuls read them.
            b, heads, d = k.shape[1:]
            self._layers[layer] = tuple(
                t.new_zeros((b, heads, self.max_length, d)).permute(2, 0, 1, 3) for t in (k, v)
            )
        keys, values = self._layers[layer]
        keys[self.length : self.length + s] = k
        values[self.length : self.length + s] = v
        read = self.slots_read(s)
        return keys[:read], values[:read]

    def advance(self, s: int) -> None:
        """Marks s more positions filled (the model calls it after its forward)."""
        self.length += s
