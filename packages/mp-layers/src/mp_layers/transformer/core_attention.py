"""Core attention: softmax(q k^T / sqrt(d)) v, causal, through torch's SDPA or blocked
matmuls.

Shapes: q and k [s, b, nq, d] and [s, b, ng, d], v [s, b, ng, dv] with nq = ng * (heads
per group), the output [s, b, nq * dv]; the value width dv may differ from d (multi-latent
attention; but not on the banded path of sinks and windows, which MLA refuses), and the
scale 1 / sqrt(d) may be given instead (softmax_scale). All heads here are this TP
rank's. Key and value heads are shared by the query heads of their group (grouped-query
attention; ng = nq is multi-head attention). Dropout on the attention probabilities runs
inside the tracker's tensor-parallel stream: the heads are sharded, so each TP rank must
draw its own mask.

Backends (TransformerConfig.attention_backend, Megatron's names):

- "flash", "fused": torch's scaled_dot_product_attention, which runs a
  flash-attention or memory-efficient kernel (CUDA) or the CPU flash kernel;
- "local", "unfused": `blocked_attention`, the probabilities written out a
  block of query positions at a time;
- "auto": blocked on a CPU when the probabilities it keeps for backward fit in
  AUTO_BLOCKED_LIMIT_BYTES[dtype] per layer (32 MiB in fp32, 128 MiB in bf16 and
  fp16), SDPA otherwise. On this project's CPU measurements (ci/bench/
  bench_attention.py, docs/layers.md) the blocked matmuls are faster within
  those limits; beyond them SDPA is as fast or faster in fp32, and the memory
  the blocked path keeps grows with s^2.

Attention sinks (softmax_type "off-by-one": a logit 0, "learnable": the parameter
softmax_offset [heads on this rank]) and a sliding window (window: the earlier keys
each query sees) go through `banded_attention` where SDPA would run (it keeps no
probabilities; no s x s mask), and through `blocked_attention` where the blocked path
would run or where an explicit mask or dropout is given.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from mp_layers.config import ATTENTION_BACKENDS
from mp_layers.context_parallel import context_parallel_attention, mixed_seed
from mp_layers.context_parallel.hierarchical import hierarchical_attention
from mp_layers.context_parallel.ulysses import ulysses_attention
from mp_layers.transformer.banded_attention import banded_attention
from mp_layers.transformer.blocked_attention import blocked_attention, saved_probability_bytes
from mp_layers.transformer.eager import eager_when_compiled
from mp_layers.transformer.max_logits import max_attention_logits
from mp_layers.transformer.packed import PackedSeqParams
from mp_state import TENSOR_PARALLEL_RNG, RankGroup, RNGStatesTracker

__all__ = [
    "AUTO_BLOCKED_LIMIT_BYTES",
    "CoreAttention",
    "cached_attention",
    "keeps_attention_probabilities",
]

AUTO_BLOCKED_LIMIT_BYTES = {
    torch.float32: 32 * 2**20,
    torch.bfloat16: 128 * 2**20,
    torch.float16: 128 * 2**20,
}


class CoreAttention(torch.nn.Module):
    def __init__(
        self,
        attention_dropout: float,
        rng_tracker: RNGStatesTracker | None,
        backend: str = "auto",
        cp_group: RankGroup | None = None,
        cp_comm_type: str = "p2p",
        *,
        softmax_type: str = "vanilla",
        window: int | None = None,
        heads: int | None = None,
        params_dtype: torch.dtype = torch.float32,
        softmax_scale: float | None = None,
        cp_levels: tuple[RankGroup, RankGroup] | None = None,
        track_max_logits: bool = False,
        score_divisor: int | None = None,
    ) -> None:
        """softmax_type, window (the earlier keys each query sees; None: all) and heads
        (this rank's query heads, for the sinks): module docstring. softmax_scale
        multiplies the logits q k^T (None: 1 / sqrt(d), d the query's width). cp_levels:
        the inner and outer context-parallel groups of cp_comm_type "a2a+p2p".
        track_max_logits: in training, keep each head's largest logit (max_logits).
        score_divisor: the layer's number under apply_query_key_layer_scaling (blocked
        attention's scores divided by it in their matmul, multiplied back in fp32)."""
        super().__init__()
        self.score_divisor = score_divisor
        self.cp_levels = cp_levels
        self.track_max_logits = track_max_logits
        self.max_logits: torch.Tensor | None = None
        """[heads] fp32: the largest logit of each of this rank's heads since the last
        reset (mp_layers.qk_clip takes and resets it), with track_max_logits."""
        self.softmax_scale = softmax_scale
        self.softmax_type = softmax_type
        self.window = window
        if softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            if heads is None:
                raise ValueError(f"softmax_type={softmax_type!r} needs heads (a sink per head)")
            offset = torch.zeros(heads, dtype=params_dtype)
            if softmax_type == "learnable":
                self.softmax_offset = torch.nn.Parameter(offset)
            elif softmax_type == "off-by-one":
                self.register_buffer("softmax_offset", offset, persistent=False)
            else:
                raise ValueError(
                    f"softmax_type={softmax_type!r} must be one of vanilla, off-by-one, learnable"
                )
        self.cp_group = cp_group if cp_group is not None and cp_group.size > 1 else None
        self.cp_comm_type = cp_comm_type
        if backend not in ATTENTION_BACKENDS:
            choices = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"attention_backend={backend!r} must be one of {choices}")
        if attention_dropout > 0 and rng_tracker is None:
            raise ValueError(
                f"attention_dropout={attention_dropout} needs an rng_tracker (mp_state.set_random_"
                "seeds returns one) so that each tensor-parallel rank draws its own masks"
            )
        self.attention_dropout = attention_dropout
        self.rng_tracker = rng_tracker
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """attention_mask: [b or 1, 1, s, s] bool, True = masked; None = causal (with a
        KVCache's keys: [b, 1, s, T]); a PackedSeqParams: causal within each document.
        With a context-parallel group, q, k and v hold this rank's load-balanced chunks
        and attention is causal over the whole sequence."""
        nq = q.shape[2]
        if nq % k.shape[2]:
            raise ValueError(f"{nq} query heads cannot share {k.shape[2]} key/value heads")
        packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
        if packed is not None and self.cp_group is None:
            if self.track_max_logits:
                self._record(q, k, documents=packed.document_ids)
            return self._attend_packed(q, k, v, packed, sink=self.softmax_offset)
        if self.cp_group is not None:
            if attention_mask is not None and packed is None:
                raise ValueError(
                    "an explicit attention mask with context parallelism: the split "
                    "sequence is attended causally, or by the documents of a PackedSeqParams"
                )
            if packed is not None and packed.cp_size != self.cp_group.size:
                raise ValueError(
                    f"a PackedSeqParams made for cp_size={packed.cp_size} under a "
                    f"context-parallel group of {self.cp_group.size}: make it with "
                    "from_document_ids(whole samples' ids, cp_size, cp_rank)"
                )
            dropout = self.attention_dropout if self.training else 0.0
            if self.cp_comm_type == "a2a":
                sink = self.softmax_offset
                if sink is not None:  # this rank attends with heads piece cp_rank (ulysses.py)
                    sink = sink.view(self.cp_group.size, -1)[self.cp_group.rank]
                piece = (self.cp_group.rank, self.cp_group.size)
                if packed is not None:  # whole sequences after the all-to-all
                    whole = packed.whole()

                    def attend_packed(q, k, v):
                        if self.track_max_logits:
                            self._record(q, k, piece, documents=whole.document_ids)
                        with self._per_cp_rank_dropout(dropout):
                            return self._attend_packed(q, k, v, whole, sink=sink)

                    return ulysses_attention(q, k, v, self.cp_group, attend_packed, packed.order)

                def attend(q, k, v):
                    if self.track_max_logits:
                        self._record(q, k, piece)
                    with self._per_cp_rank_dropout(dropout):
                        return self._attend(q, k, v, sink=sink)

                return ulysses_attention(q, k, v, self.cp_group, attend)
            if self.cp_comm_type == "a2a+p2p":
                return self._attend_hierarchical(q, k, v, packed, dropout)
            documents = chunks = None
            if packed is not None and packed.split == "document":
                chunks = packed.chunk_segments
            elif packed is not None:
                documents = packed.whole_document_ids
            return context_parallel_attention(
                q, k, v, self.cp_group, scale=self._scale(q), comm_type=self.cp_comm_type,
                documents=documents, document_chunks=chunks, window=self.window,
                sink=self.softmax_offset, dropout=dropout,
                dropout_seed=self._dropout_seed(q.device) if dropout > 0 else 0,
            )  # fmt: skip
        if self.track_max_logits:  # (a call to an eager function breaks a compiled graph)
            self._record(q, k, attention_mask=attention_mask)
        return self._attend(q, k, v, attention_mask, sink=self.softmax_offset)

    @contextlib.contextmanager
    def _per_cp_rank_dropout(self, dropout: float) -> Iterator[None]:
        """Inside, with dropout, the tensor-parallel stream is one of this context-parallel
        rank's own, seeded from a number the stream draws (the same on every CP rank): after
        the all-to-all each CP rank attends with other heads, which must not share one
        rank's masks. The stream goes on after the block as if the block had drawn that
        one number, on every CP rank alike (and again when recomputed)."""
        if dropout == 0:
            yield
            return
        seed = self._dropout_seed(torch.device(self.rng_tracker.device))
        own = torch.Generator(device=self.rng_tracker.device)
        own.manual_seed(mixed_seed(seed, self.cp_group.rank))
        stream = self.rng_tracker.get_states()[TENSOR_PARALLEL_RNG]
        self.rng_tracker.set_states({TENSOR_PARALLEL_RNG: own.get_state()})
        try:
            yield
        finally:
            self.rng_tracker.set_states({TENSOR_PARALLEL_RNG: stream})

    @eager_when_compiled
    def _dropout_seed(self, device: torch.device) -> int:
        """A seed for the dropout masks of attention across context-parallel ranks, drawn
        from the tensor-parallel stream (each TP rank's heads their own masks; a recomputed
        forward draws it again from the restored stream). Eager in a compiled layer: the
        number leaves the device."""
        with self.rng_tracker.fork(TENSOR_PARALLEL_RNG):
            return int(torch.randint(1 << 62, (1,), device=device).item())

    @eager_when_compiled
    def _record(self, q, k, piece: tuple[int, int] | None = None, **masks) -> None:
        """With track_max_logits in training, folds these queries' and keys' largest
        logits into max_logits; piece (index, count): the heads are that piece of this
        rank's (the all-to-all's), the others' get -inf."""
        if not (self.track_max_logits and self.training) or q.shape[0] < k.shape[0]:
            return
        found = max_attention_logits(q, k, self._scale(q), window=self.window, **masks)
        if piece is not None:
            index, count = piece
            heads = torch.full((count * found.numel(),), -torch.inf, device=found.device)
            heads[index * found.numel() : (index + 1) * found.numel()] = found
            found = heads
        self.max_logits = found if self.max_logits is None else torch.maximum(
            self.max_logits, found)  # fmt: skip

    def _attend_hierarchical(self, q, k, v, packed, dropout: float) -> torch.Tensor:
        """cp_comm_type "a2a+p2p": context_parallel/hierarchical.py."""
        if self.cp_levels is None:
            raise ValueError(
                "cp_comm_type='a2a+p2p' needs the hierarchical context-parallel groups: set "
                "hierarchical_context_parallel_sizes (Megatron's "
                "--hierarchical-context-parallel-sizes)"
            )
        if packed is not None:
            raise ValueError("packed documents with cp_comm_type='a2a+p2p' are not "
                             "implemented: use p2p, all_gather or a2a")  # fmt: skip
        inner, outer = self.cp_levels
        sink = self.softmax_offset
        mine = None if sink is None else sink.view(inner.size, -1)[inner.rank]

        def attend(q, k, v):  # an outer group of one rank: this rank's heads, whole sequences
            with self._per_cp_rank_dropout(dropout):
                return self._attend(q, k, v, sink=mine)

        seed = self._dropout_seed(q.device) if dropout > 0 and outer.size > 1 else 0
        return hierarchical_attention(
            q, k, v, self.cp_group, self.cp_levels, self._scale(q), attend, window=self.window,
            sink=sink, dropout=dropout, dropout_seed=seed,
        )  # fmt: skip

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over whole sequences on this rank; sink [nq] or None."""
        s, b, nq, _ = q.shape
        dropout = self.attention_dropout if self.training else 0.0
        scale = self._scale(q)
        if s < k.shape[0]:  # generation: the next positions over a KVCache's keys
            return cached_attention(q, k, v, attention_mask, scale, sink=sink)
        blocked = self.uses_blocked(q, explicit_mask=attention_mask is not None)
        if sink is not None or self.window is not None:
            if not blocked and attention_mask is None and dropout == 0:
                return banded_attention(q, k, v, scale=scale, window=self.window, sink=sink)
            blocked = True
        if blocked:
            return blocked_attention(
                q, k, v, attention_mask, scale=scale, dropout=dropout,
                rng_tracker=self.rng_tracker, window=self.window, sink=sink,
                score_divisor=self.score_divisor,
            )  # fmt: skip
        # SDPA wants [b, n, s, d]; it shares each key/value head among its group's
        # query heads itself (enable_gqa), without materializing repeated k and v.
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        kwargs = {"dropout_p": dropout, "scale": scale, "enable_gqa": nq != k.shape[2]}
        if attention_mask is None:
            kwargs["is_causal"] = True
        else:
            kwargs["attn_mask"] = ~attention_mask
        if dropout > 0:
            with self.rng_tracker.fork(TENSOR_PARALLEL_RNG):
                out = F.scaled_dot_product_attention(q_, k_, v_, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q_, k_, v_, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, nq * v.shape[-1])

    @eager_when_compiled
    def _attend_packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSeqParams,
        *, sink: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Each document of each sample attended as a sequence of its own (causal), so
        that no score crosses documents and none is computed for pairs of them: on a GPU
        in one variable-length flash kernel where it applies (_varlen_fits), otherwise
        one document at a time through _attend. Eager in a compiled layer: the documents'
        bounds are each batch's own (the kernel's longest document, the lengths of the
        pieces), which compiled would recompile the attention at every new one until
        torch's recompile limit left it eager anyway."""
        s, b = q.shape[:2]
        if tuple(packed.document_ids.shape) != (b, s):
            raise ValueError(
                f"document_ids of shape {tuple(packed.document_ids.shape)} for queries of "
                f"{b} samples of {s} positions"
            )
        dropout = self.attention_dropout if self.training else 0.0
        if sink is None and self.window is None and dropout == 0 and _varlen_fits(q, v):
            return _varlen_packed(q, k, v, packed, self._scale(q))
        samples = []
        for i, documents in enumerate(packed.segments):
            one = (slice(None), slice(i, i + 1))
            parts = []
            for a, e in documents:
                part = tuple(t[one][a:e] for t in (q, k, v))
                parts.append(self._attend(*part, sink=sink))
            samples.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return torch.cat(samples, dim=1) if b > 1 else samples[0]

    def _scale(self, q: torch.Tensor) -> float:
        return 1.0 / math.sqrt(q.shape[-1]) if self.softmax_scale is None else self.softmax_scale

    def uses_blocked(self, q: torch.Tensor, explicit_mask: bool = False) -> bool:
        """Whether attention over these queries [s, b, heads, d] goes through
        blocked_attention (True) or SDPA (False)."""
        s, b, heads, _ = q.shape
        return keeps_attention_probabilities(
            self.backend, q.device.type, s, b, heads, q.dtype, explicit_mask=explicit_mask
        )


def _varlen_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's variable-length flash attention (torch.nn.attention.varlen) takes
    these queries: on CUDA, fp16 / bf16, one head width of at most 256, and a torch whose
    varlen_attn has the causal window and grouped-query arguments."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] != v.shape[-1] or q.shape[-1] > 256:
        return False
    return _varlen_attn() is not None


@functools.cache
def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    wanted = {"window_size", "enable_gqa", "scale"}
    return varlen_attn if wanted <= set(inspect.signature(varlen_attn).parameters) else None


def _varlen_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSeqParams, scale: float
) -> torch.Tensor:
    """Every document of the batch in one varlen flash call: the samples flattened one
    after the other ([b x s, heads, d]), the documents' bounds packed.cu_seqlens, causal
    within each (window (-1, 0))."""
    s, b, nq, _ = q.shape

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1).reshape(b * s, t.shape[2], t.shape[3])

    cu = packed.cu_seqlens.to(q.device)
    longest = max(e - a for row in packed.segments for a, e in row)
    out = _varlen_attn()(
        flat(q), flat(k), flat(v), cu, cu, longest, longest, scale=scale,
        window_size=(-1, 0), enable_gqa=nq != k.shape[2],
    )  # fmt: skip
    return out.view(b, s, nq * v.shape[-1]).transpose(0, 1).reshape(s, b, nq * v.shape[-1])


def keeps_attention_probabilities(
    backend: str,
    device_type: str,
    s: int,
    b: int,
    heads: int,
    dtype: torch.dtype,
    *,
    explicit_mask: bool = False,
) -> bool:
    """Whether core attention over s query positions (b samples, `heads` heads on this
    rank) runs blocked_attention, which keeps its probabilities for backward, rather than
    SDPA, which keeps none: "local"/"unfused" always, "flash"/"fused" never, "auto" on a
    CPU within AUTO_BLOCKED_LIMIT_BYTES. With an explicit mask no block is skipped, so the
    probabilities kept are the full square."""
    if backend in ("local", "unfused"):
        return True
    if backend in ("flash", "fused") or device_type != "cpu":
        return False
    saved = saved_probability_bytes(
        s, b, heads, torch.empty((), dtype=dtype).element_size(), causal=not explicit_mask
    )
    return saved <= AUTO_BLOCKED_LIMIT_BYTES.get(dtype, 0)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the next s positions q [s, b, nq, d] over a KVCache's keys and values
    k [T, b, ng, d], v [T, b, ng, dv] (T > s; views of [b, ng, T', d] storage, the cache's or a
    windowed layer's ring beside the new keys), mask [b, 1, s, T] bool, True = masked
    (None: every key visible; a sliding window is part of the mask,
    KVCache.update_window); sink [nq] logits or None; the output [s, b, nq * dv].

    Two matmuls and a softmax in fp32, for generation: with one query a sequence,
    SDPA's CPU flash kernel fills a whole block of queries per head and copies the
    strided cache (2.7 ms a layer at b 8 in bf16 against 0.3 ms here, ci/bench/
    bench_generate.py). The scores are taken as k q^T, [b, ng, T, qs]: a CPU bf16 matmul
    reads the cache's rows in place that way, where q k^T would copy them transposed.
    A group's query heads share its key/value head (grouped-query attention)."""
    s, b, nq, d = q.shape
    t, ng = k.shape[0], k.shape[2]
    per_group = nq // ng
    q_ = q.permute(1, 2, 0, 3).reshape(b, ng, per_group * s, d)  # rows (head, position)
    k_, v_ = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, ng, T, d]
    scores = torch.matmul(k_, q_.transpose(-1, -2)).float().mul_(scale)  # [b, ng, T, qs]
    if mask is not None:
        masked = mask.view(b, 1, s, t).transpose(-1, -2)[:, :, :, None, :]  # [b, 1, T, 1, s]
        scores.view(b, ng, t, per_group, s).masked_fill_(masked, float("-inf"))
    if sink is not None:  # one more key row: the sink's logit, no value
        column = sink.float().view(1, ng, 1, per_group, 1).expand(b, ng, 1, per_group, s)
        scores = torch.cat([scores, column.reshape(b, ng, 1, per_group * s)], dim=2)
        probs = torch.softmax(scores, dim=2)[:, :, :t].to(v.dtype)
    else:
        probs = torch.softmax(scores, dim=2).to(v.dtype)
    out = torch.matmul(probs.transpose(-1, -2), v_)  # [b, ng, qs, dv]
    dv = v.shape[-1]
    return out.view(b, nq, s, dv).permute(2, 0, 1, 3).reshape(s, b, nq * dv)
