"""The keys and values of the positions a model has seen, for generation one token at a
time (Megatron's inference context).

    cache = KVCache(padding=torch.tensor([2, 0]), max_length=40)   # two prompts, left-padded
    logits = model(prompt_ids, kv_cache=cache)       # prefill: every prompt position
    logits = model(next_ids[:, None], kv_cache=cache)   # then one new position per call

The b sequences share one time axis: prompts of different lengths are padded on the
left, `padding[i]` positions for sequence i, so that every sequence's next token goes
to the same slot. A sequence's positions (for RoPE or learned position embeddings)
count from its first real token; its padding is never attended to. A pipeline stage's
model fills the layers it holds. Each layer's keys and values are allocated on first
use with the layer's dtype and device; grouped-query attention caches only the groups'
heads.

A full-attention layer keeps [max_length, b, key/value heads on this rank, d] (stored
[b, heads, max_length, d]). A layer with a sliding window of `window` earlier keys keeps
only a ring of `ring_size(window)` slots (at least window + 1, rounded up to KEY_BLOCK,
at most max_length): time slot t lives in ring entry t % ring size, so the ring holds
the latest positions and its size, hence the layer's memory, does not grow with
max_length. Attention over the ring masks by the slot each entry holds (`ring_slots`);
softmax does not depend on the keys' order, and keys are cached after RoPE, so the
ring's order does not matter.

A multi-latent attention layer keeps one tensor, [max_length, b, 1, kv_lora_rank +
qk_pos_emb_head_dim] (stored [b, 1, max_length, w]): each position's normalized key/value
latent and its rotated key, from which every head's key and value are computed
(`update_latent`; multi_latent_attention.py attends in the latent space).

A layer with chunked attention (Llama 4) keeps every position, as a full-attention
layer, and masks the keys of earlier blocks (`chunked_attention_mask`).

A Mamba layer (hybrid models) keeps no keys but its states after the filled slots: its
convolution's last K - 1 inputs [b, channels, K - 1] and its scan's state [b, heads, p,
n] in fp32 (`mamba_states`, `set_mamba_states`), whatever the length; a sequence's
padding slots leave them as they were (`padded`: mamba_mixer.py zeroes their inputs and
their step size).
"""

from __future__ import annotations

import torch

from mp_layers.transformer.chunked_attention import block_mask

__all__ = ["KEY_BLOCK", "KVCache", "ring_slots"]

KEY_BLOCK = 64
"""After the prompts, attention reads the cache's keys in multiples of this many slots
(KVCache.slots_read), and a windowed layer's ring holds a multiple of it."""


def ring_slots(length: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[size] long: the time slot ring entry j holds once `length` slots are filled, the
    latest t < length with t % size == j; negative for an entry not yet filled."""
    entries = torch.arange(size, device=device)
    return entries + size * torch.div(length - 1 - entries, size, rounding_mode="floor")


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
        self._layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._window_masks: dict[tuple[int, int, bool], torch.Tensor] = {}
        """This forward's masks of the windowed layers, by (window, s, in place)."""
        self._block_masks: dict[tuple[int, int], torch.Tensor] = {}
        """This forward's masks of the chunked layers, by (chunk, s)."""

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
        """T, the key slots a full-attention layer reads for the next s positions: length + s
        for the prompts (the first forward), after them length + s rounded up to KEY_BLOCK
        slots (at most max_length). The slots past length + s hold zeros and are masked.
        Why: a CPU bf16 matmul (oneDNN) builds a kernel for each new shape and keeps 1,024
        of them; a key count growing by one each step would build two a step per layer
        shape and, past 512 steps, evict each before its reuse (about 1 ms a step at
        batch 1, ci/bench/bench_generate.py)."""
        total = self.length + s
        if self.length == 0:
            return total
        return min(-(-total // KEY_BLOCK) * KEY_BLOCK, self.max_length)

    def ring_size(self, window: int) -> int:
        """The slots a layer with a sliding window of `window` earlier keys keeps: its
        window and the newest position, rounded up to KEY_BLOCK (one kernel shape a step,
        slots_read, and room for a few new positions at once), at most max_length."""
        return min(-(-(window + 1) // KEY_BLOCK) * KEY_BLOCK, self.max_length)

    def attention_mask(self, s: int, device: torch.device | str) -> torch.Tensor:
        """[b, 1, s, T] bool (T = slots_read(s)), True = masked: the next s slots attend
        causally to every filled slot but padding. A padding slot attends to itself alone
        (a row with nothing to attend to would give NaN, which would reach the real
        positions through the values)."""
        keys = torch.arange(self.slots_read(s), device=device)
        return self._mask(s, keys, None)

    def chunked_attention_mask(
        self, s: int, chunk: int, device: torch.device | str
    ) -> torch.Tensor:
        """attention_mask(s) of a layer attending within aligned blocks of `chunk`
        positions (Llama 4's chunked attention, chunked_attention.py): also masked, the
        keys of earlier blocks than their query's. Blocks count from each sequence's
        first real token, as its positions do."""
        if (chunk, s) not in self._block_masks:
            keys = self.slots_read(s)
            key_positions = (torch.arange(keys, device=device)[None, :]
                             - self.padding.to(device)[:, None]).clamp(min=0)  # fmt: skip
            outside = block_mask(self.position_ids(s, device), key_positions, chunk)
            self._block_masks[chunk, s] = self.attention_mask(s, device) | outside
        return self._block_masks[chunk, s]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new positions' keys and values [s, b, heads, d] of the full-attention
        `layer` (its number in the whole model) after the filled ones; returns those of
        the slots attention reads, [slots_read(s), b, heads, d]."""
        s = k.shape[0]
        keys, values = self._storage(layer, (k, v), self.max_length)
        keys[self.length : self.length + s] = k
        values[self.length : self.length + s] = v
        read = self.slots_read(s)
        return keys[:read], values[:read]

    def update_window(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [T, b, heads, d] and mask [b, 1, s, T] (True = masked) the next s
        positions of a layer with a sliding window of `window` earlier keys attend to, given
        their keys and values k, v [s, b, heads, d]; keeps the last ring_size(window) of
        them in the layer's ring (module docstring).

        The prompts (length 0) attend to their own keys, T = s. Later, when writing the
        new positions into the ring overwrites no key their queries still see, they go in
        first and attention reads the ring (T = ring size: one shape a step); otherwise
        (many positions at once) attention reads the ring and the new keys side by side
        (T = ring size + s) before they are written. The mask hides empty entries, padding,
        future keys and those more than `window` positions back."""
        s = k.shape[0]
        size = self.ring_size(window)
        keys, values = self._storage(layer, (k, v), size)
        in_place = self._writes_first(s, window, size)
        mask_key = (window, s, in_place)
        if mask_key not in self._window_masks:
            self._window_masks[mask_key] = self._window_mask(s, window, size, in_place, k.device)
        mask = self._window_masks[mask_key]
        if in_place:
            self._write_ring(keys, values, k, v)
            return keys, values, mask
        read_k, read_v = (k, v) if self.length == 0 else (_beside(keys, k), _beside(values, v))
        self._write_ring(keys, values, k, v)
        return read_k, read_v, mask

    def update_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Stores the new positions' latents [s, b, 1, w] of the multi-latent attention
        `layer` after the filled ones; returns those of the slots attention reads,
        [slots_read(s), b, 1, w] (module docstring)."""
        s = latent.shape[0]
        (stored,) = self._storage(layer, (latent,), self.max_length)
        stored[self.length : self.length + s] = latent
        return stored[: self.slots_read(s)]

    def padded(self, s: int, device: torch.device | str) -> torch.Tensor:
        """[b, s] bool: which of the next s slots are padding."""
        slots = torch.arange(self.length, self.length + s, device=device)
        return slots[None, :] < self.padding.to(device)[:, None]

    def mamba_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The Mamba `layer`'s states after the filled slots (its convolution's last inputs
        and its scan's state), None before its first forward."""
        return self._layers.get(layer)

    def set_mamba_states(self, layer: int, conv: torch.Tensor, scan: torch.Tensor) -> None:
        """Replaces the Mamba `layer`'s states (mamba_mixer.py: conv [b, channels, K - 1]
        of the last inputs, scan [b, heads, p, n] fp32) by those after the new slots."""
        self._layers[layer] = (conv, scan)

    def layer_bytes(self, layer: int) -> int:
        """The bytes `layer`'s keys and values (or latents) hold (0 before its first
        update)."""
        if layer not in self._layers:
            return 0
        return sum(t.untyped_storage().nbytes() for t in self._layers[layer])

    def advance(self, s: int) -> None:
        """Marks s more positions filled (the model calls it after its forward)."""
        self.length += s
        self._window_masks.clear()
        self._block_masks.clear()

    def _storage(
        self, layer: int, new: tuple[torch.Tensor, ...], slots: int
    ) -> tuple[torch.Tensor, ...]:
        """The layer's keys and values (or latents), like the new positions' [s, b, heads,
        d] each: [slots, b, heads, d] views of [b, heads, slots, d] storage (each head's
        positions are rows of one matrix, as attention's matmuls read them), allocated on
        first use."""
        if new[0].shape[1] != self.batch_size:
            raise ValueError(f"keys of {new[0].shape[1]} sequences in a cache of {self.batch_size}")
        if layer not in self._layers:
            self._layers[layer] = tuple(
                t.new_zeros((*t.shape[1:3], slots, t.shape[3])).permute(2, 0, 1, 3) for t in new
            )
        return self._layers[layer]

    def _writes_first(self, s: int, window: int, size: int) -> bool:
        """Whether the next s positions of a windowed layer go into its ring before
        attention: after the prompts, fewer than the ring's slots, overwriting only slots
        before the first new query's window (or none: the ring has not wrapped yet)."""
        if self.length == 0 or s >= size:
            return False
        return s <= size - window or self.length + s <= size

    def _write_ring(self, keys, values, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the last (at most ring size) new positions into ring entries slot % size."""
        size, s = keys.shape[0], k.shape[0]
        n = min(s, size)
        start = (self.length + s - n) % size
        head = min(n, size - start)  # up to the ring's end, the rest from entry 0
        for stored, new in ((keys, k[s - n :]), (values, v[s - n :])):
            stored[start : start + head] = new[:head]
            stored[: n - head] = new[head:]

    def _window_mask(
        self, s: int, window: int, size: int, in_place: bool, device: torch.device | str
    ) -> torch.Tensor:
        """[b, 1, s, T] bool, True = masked, over the keys update_window returns."""
        new = torch.arange(self.length, self.length + s, device=device)
        if in_place:
            keys = ring_slots(self.length + s, size, device)
        elif self.length == 0:
            keys = new
        else:
            keys = torch.cat([ring_slots(self.length, size, device), new])
        return self._mask(s, keys, window)

    def _mask(self, s: int, keys: torch.Tensor, window: int | None) -> torch.Tensor:
        """[b, 1, s, T] bool, True = masked, of the next s slots over the keys holding time
        slots keys [T]: future keys, padding (a padding slot attends to itself alone) and,
        with a window, the keys more than `window` slots back. A negative slot (an empty
        ring entry) is before every sequence's first slot, so masked as padding."""
        queries = torch.arange(self.length, self.length + s, device=keys.device)[:, None]
        padded = keys[None, None] < self.padding.to(keys.device)[:, None, None]  # [b, 1, T]
        masked = (keys > queries)[None] | (padded & (keys != queries)[None])  # [b, s, T]
        if window is not None:
            masked = masked | (keys < queries - window)[None]
        return masked[:, None]


def _beside(ring: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[size + s, b, heads, d]: a ring's entries, then the new positions, as a view of
    [b, heads, size + s, d] storage (each head's keys the rows of one matrix)."""
    return torch.cat([ring.permute(1, 2, 0, 3), new.permute(1, 2, 0, 3)], dim=2).permute(2, 0, 1, 3)
