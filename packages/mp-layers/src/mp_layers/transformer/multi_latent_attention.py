"""Multi-latent attention (DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3, Kimi K2) with
Megatron-LM's module names and tensor-parallel layout (its MLASelfAttention).

Shapes: x [s, b, h] ([s/tp, b, h] with sequence parallelism); n heads, nl = n/tp of them
on this rank; dn = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim, r =
kv_lora_rank, rq = q_lora_rank.

    queries  linear_q_down_proj [rq, h] -> q_layernorm -> linear_q_up_proj [n (dn + dr), rq]
             (or linear_q_proj [n (dn + dr), h] without q_lora_rank): per head q_nope [dn],
             q_rope [dr]
    latent   linear_kv_down_proj [r + dr, h] -> c [r] (then kv_layernorm), k_rope [dr]
    keys     linear_kv_up_proj [n (dn + dv), r] of c: per head k_nope [dn], v [dv]
    output   linear_proj [h, n dv]

Head i attends with query (q_nope, rope(q_rope)) and key (k_nope, rope(k_rope)): the
rotated part of the key is one for all heads. The logits are scaled by
mscale^2 / sqrt(dn + dr) with mscale = 0.1 mscale_all_dim ln(s) + 1 under YaRN of factor
s, else 1 (Megatron's and DeepSeek's softmax scale; rope.py). The rope parts keep
DeepSeek's layout, channel pairs (2i, 2i + 1): they are regrouped as (even, odd) halves
before rotating (Megatron's mla_rotary_interleaved, transformers' rope_interleave), which
permutes the rotated channels of queries and keys alike and leaves the logits DeepSeek's.

Tensor parallelism as Megatron's: the up projections are column-parallel and the output
projection row-parallel, so a rank holds nl whole heads; the down projections and the
latent norms are replicated. Under sequence parallelism those run on this rank's s/tp
positions and their parameters carry `sequence_parallel` (their gradients summed over the
TP group, as the layer norms'); the up projections gather the latents along s and k_rope
is gathered for the heads. Without it k_rope enters the heads through the copy-to-TP
mapping, whose backward sums the heads' gradients over the ranks, as a column-parallel
layer does for its input.

sharded_state_dict names Megatron's tensors (its local spec): linear_q_down_proj.weight,
q_layernorm.*, linear_q_up_proj.weight (or linear_q_proj.weight),
linear_kv_down_proj.weight, kv_layernorm.*, linear_kv_up_proj.weight, linear_proj.*. The up
projections hold each head's rows together (dn + dr, or dn + dv), as Megatron and
Hugging Face store them, so the TP split gives whole heads and the logical tensor is the
checkpoint's own.

With experimental_attention_variant "dsa" (DeepSeek-V3.2, GLM-5) each query attends to
the positions a lightning indexer chose (sparse_attention.py; the indexer's tensors under
core_attention.indexer., Megatron's names): this layer's, or with dsa_indexer_topk_freq
the last layer's that chose for it, carried in the forward's Rotary. Under context
parallelism the rank's queries attend to the all-gathered keys and values.

Generation with a KVCache keeps, per position, the latent (c, rope(k_rope)): r + dr
channels instead of n (dn + dr + dv) keys and values. Attention runs in the latent space
(the weight absorption of DeepSeek-V2's section 2.1.3): with W_uk [dn, r] and W_uv [dv, r]
a head's rows of linear_kv_up_proj, q_nope . (W_uk c) = (W_uk^T q_nope) . c, so the query
(W_uk^T q_nope, rope(q_rope)) attends over the latents as keys (one group for all heads),
and W_uv times the weighted sum of the c gives the head's value.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_dsa import dsa_choice_source, uses_dsa
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    replicated_state_dict,
)
from mp_layers.transformer.attention import layer_scaling
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.mlp import residual_projection
from mp_layers.transformer.output_recompute import OutputRecompute
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.recompute import checkpointed
from mp_layers.transformer.rope import Rotary, apply_rotary_pos_emb, yarn_mscale, yarn_scaling
from mp_layers.transformer.sparse_attention import (
    LightningIndexer,
    causal_over_ranks,
    chosen_positions,
    gather_sequence,
    index_scores,
    indexer_loss,
    masked_attention,
)
from mp_state import RankGroup, RNGStatesTracker

if TYPE_CHECKING:
    from mp_layers.transformer.spec import LayerSpec

__all__ = ["MultiLatentAttention", "mla_softmax_scale"]

_REPLICATED = ("linear_q_down_proj", "q_layernorm", "linear_kv_down_proj", "kv_layernorm")
_SPLIT = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj")


def mla_softmax_scale(config: TransformerConfig) -> float:
    """mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim) (module docstring)."""
    scaling = yarn_scaling(config)
    mscale = 1.0 if scaling is None else yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class MultiLatentAttention(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        *,
        spec: LayerSpec,
        layer_number: int = 0,
    ) -> None:
        """layer_number: the layer's index in the whole model (its place in a KVCache)."""
        super().__init__()
        self.layer_number = layer_number
        tp_group = groups.tp
        config.check_parallel(tp_group.size, groups.cp.size)
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        n, h = config.num_attention_heads, config.hidden_size
        self.heads = n // tp_group.size  # on this rank
        self.dn, self.dr = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.dv, self.r = config.v_head_dim, config.kv_lora_rank
        normal = functools.partial(torch.nn.init.normal_, std=config.hidden_init_std)
        column = functools.partial(
            ColumnParallelLinear, tp_group=tp_group, bias=False,
            sequence_parallel=config.sequence_parallel, init_method=normal,
            params_dtype=config.params_dtype,
        )  # fmt: skip
        # A column-parallel layer over this rank alone: the whole weight, on every rank.
        alone = RankGroup(tp_group.kind, (tp_group.global_rank,), 0, None)
        replicated = functools.partial(
            ColumnParallelLinear, tp_group=alone, bias=False, init_method=normal,
            params_dtype=config.params_dtype,
        )  # fmt: skip

        def latent_norm(size: int) -> torch.nn.Module:  # Megatron's IdentityOp without them
            if not config.qk_layernorm:
                return torch.nn.Identity()
            norm = spec.norm(config, size)
            if config.latent_norm_epsilon is not None:
                norm.eps = config.latent_norm_epsilon
            return norm

        q_width = n * (self.dn + self.dr)
        self.linear_q_proj = self.linear_q_down_proj = self.linear_q_up_proj = None
        self.q_layernorm = None
        if config.q_lora_rank is None:
            self.linear_q_proj = column(h, q_width)
        else:
            self.linear_q_down_proj = replicated(h, config.q_lora_rank)
            self.q_layernorm = latent_norm(config.q_lora_rank)
            self.linear_q_up_proj = column(config.q_lora_rank, q_width)
        self.linear_kv_down_proj = replicated(h, self.r + self.dr)
        self.kv_layernorm = latent_norm(self.r)
        self.linear_kv_up_proj = column(self.r, n * (self.dn + self.dv))
        for module in (self.linear_q_down_proj, self.linear_kv_down_proj):  # norms: their own
            for p in module.parameters() if module is not None else ():
                p.sequence_parallel = config.sequence_parallel
        self.dsa = uses_dsa(config)
        self.cp_group = groups.cp
        self.core_attention = spec.core_attention(
            # DeepSeek sparse attention drops no probabilities (Megatron's DSAttention)
            0.0 if self.dsa else config.attention_dropout, rng_tracker, config.attention_backend,
            cp_group=groups.cp, cp_comm_type=config.cp_comm_type, cp_levels=groups.cp_levels,
            track_max_logits=config.tracks_max_attention_logit,
            softmax_scale=mla_softmax_scale(config), params_dtype=config.params_dtype,
            **layer_scaling(config, layer_number),
        )  # fmt: skip
        # Selective recompute (Korthikanti et al.): core attention only, as SelfAttention.
        self.recompute_core_attention = config.recomputes("core_attn")
        self.recompute_up_proj = config.recomputes("mla_up_proj")
        self.rng_tracker = rng_tracker
        self.linear_proj = residual_projection(config, tp_group, n * self.dv)
        # DeepSeek sparse attention (sparse_attention.py): the indexer picks the keys, this
        # layer's or, shared across layers (dsa_indexer_topk_freq), its source layer's.
        self.choice_source = dsa_choice_source(config, layer_number) if self.dsa else None
        computes = self.dsa and self.choice_source == layer_number
        self.indexer = LightningIndexer(config, replicated) if computes else None
        self._new_indexer = functools.partial(LightningIndexer, config, replicated)
        self.topk = config.dsa_indexer_topk
        self.softmax_scale = mla_softmax_scale(config)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [s, b, h] -> (output [s, b, h], projection bias or None); rotary: the
        rotations of qk_pos_emb_head_dim channels. With a kv_cache, x holds the next
        positions only; their latents join the cache's (module docstring)."""
        if rotary is None:
            raise ValueError(
                "multi-latent attention needs rotary embeddings of qk_pos_emb_head_dim "
                "channels (GPTModel's)"
            )
        # the queries' input: x, or their latent after q_layernorm
        q_in = x if self.linear_q_proj is not None else self.q_layernorm(
            self.linear_q_down_proj(x)[0])  # fmt: skip
        latent, _ = self.linear_kv_down_proj(x)  # [s(/tp), b, r + dr]
        c, k_rope = latent.split([self.r, self.dr], dim=-1)
        c = self.kv_layernorm(c)
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope, self.tp_group)
        else:
            k_rope = copy_to_tensor_model_parallel_region(k_rope, self.tp_group)
        index = None if self.indexer is None else self._index(x, q_in, rotary)
        if kv_cache is not None:
            q_nope, q_rope = self._queries(q_in, rotary)
            k_rope = apply_rotary_pos_emb(_pairs_as_halves(k_rope)[:, :, None], rotary)
            return self._attend_latents(q_nope, q_rope, c, k_rope, attention_mask, kv_cache,
                                        index, rotary)  # fmt: skip
        # selective "mla_up_proj": the queries, keys and values discarded once core
        # attention saved them (output_recompute.py)
        kept = OutputRecompute(self.recompute_up_proj and self.training)
        query, key, v = kept.run(functools.partial(self._up_projections, rotary=rotary),
                                 q_in, c, k_rope)  # fmt: skip
        if self.dsa:
            context = self._sparse_attention(query, key, v, index, attention_mask, rotary)
        else:
            context = self._attend(self.core_attention, query, key, v, attention_mask)
        kept.discard(context)
        return self.linear_proj(context)

    def _attend(self, attend, query, key, v, mask):
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            return checkpointed(attend, self.rng_tracker, query, key, v, mask)
        return attend(query, key, v, mask)

    def _sparse_attention(self, query, key, v, index, attention_mask, rotary: Rotary):
        """DeepSeek sparse attention (sparse_attention.py): query [s, b, nl, dq] over the
        positions this layer's indexer (index: its q, k and w) or its source layer
        chose, and the indexer's loss. Under context parallelism the queries are this
        rank's chunks and the keys, values and indexer keys are gathered whole."""
        cp = self.cp_group
        if cp.size > 1:
            if attention_mask is not None:
                raise ValueError(
                    "DeepSeek sparse attention under context parallelism attends whole "
                    "sequences causally: packed documents or an explicit mask are not "
                    "implemented"
                )
            key, v = gather_sequence(key, cp), gather_sequence(v, cp)
        scores = valid = None
        if index is not None:
            q_i, k_i, w_i = index
            k_i = gather_sequence(k_i, cp) if cp.size > 1 else k_i
            scores = index_scores(q_i, k_i, w_i, relu=self.indexer.relu)
            allowed = (causal_over_ranks(scores.shape[-1], cp, scores.device) if cp.size > 1
                       else _allowed(attention_mask, scores.shape[1], scores.device))  # fmt: skip
            chosen = self._share(rotary, chosen_positions(scores, allowed, self.topk))
            valid = chosen if self.indexer.sparse_loss else allowed
        else:
            chosen = self._shared(rotary)
        attend = self.core_attention
        if cp.size > 1:  # the rank's queries over whole keys: no ring to run
            attend = functools.partial(masked_attention, scale=self.softmax_scale)
        context = self._attend(attend, query, key, v, ~chosen[:, None])
        if scores is not None and scores.requires_grad:  # the indexer's loss
            loss = indexer_loss(scores, query, key, self.softmax_scale, valid, self.tp_group,
                                self.indexer.per_token_loss)  # fmt: skip
            context = self.indexer.attach_loss(context, loss)
        return context

    def choose_own(self) -> None:
        """With DeepSeek sparse attention, an indexer of this layer's own whatever its
        number (a multi-token prediction module's layer: config_dsa)."""
        if self.dsa and self.indexer is None:
            self.indexer = self._new_indexer()
            self.choice_source = self.layer_number

    def _share(self, rotary: Rotary, chosen: torch.Tensor) -> torch.Tensor:
        """Keeps this layer's chosen positions [b, s, t] for the layers that reuse them."""
        if rotary.chosen is not None:
            rotary.chosen[self.layer_number] = chosen
        return chosen

    def _shared(self, rotary: Rotary) -> torch.Tensor:
        """The positions this layer's source layer chose in this forward."""
        held = rotary.chosen or {}
        if self.choice_source not in held:
            raise RuntimeError(
                f"layer {self.layer_number + 1} reuses the positions layer "
                f"{self.choice_source + 1} chooses, which did not run before it in this "
                "forward (GPTModel carries them in its Rotary)"
            )
        return held[self.choice_source]

    def _index(self, x, q_in, rotary: Rotary):
        """The indexer's q, k and w (sparse_attention.py) for whole sequences, from x and
        q_in detached; with their graph only where the indexer loss trains it."""
        x, q_in = x.detach(), q_in.detach()
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
            q_in = gather_from_sequence_parallel_region(q_in, self.tp_group)
        trains = self.training and torch.is_grad_enabled() and self.indexer.loss_coeff > 0
        with torch.set_grad_enabled(trains):
            return self.indexer(x, q_in, rotary)

    def _queries(self, q_in: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """q_in [s(/tp), b, rq or h] -> q_nope [s, b, nl, dn], rotated q_rope [s, b, nl, dr]."""
        up = self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj
        q, _ = up(q_in)
        s, b = q.shape[:2]
        q_nope, q_rope = q.view(s, b, self.heads, self.dn + self.dr).split([self.dn, self.dr], -1)
        return q_nope, apply_rotary_pos_emb(_pairs_as_halves(q_rope), rotary)

    def _up_projections(self, q_in, c, k_rope, rotary: Rotary):
        """The up projections and rotary embeddings: q_in, c [s(/tp), b, r], k_rope
        [s, b, dr] (gathered) -> query [s, b, nl, dn + dr], key [s, b, nl, dn + dr],
        value [s, b, nl, dv]."""
        q_nope, q_rope = self._queries(q_in, rotary)
        s, b = q_nope.shape[:2]
        k_rope = apply_rotary_pos_emb(_pairs_as_halves(k_rope)[:, :, None], rotary)
        kv, _ = self.linear_kv_up_proj(c)
        k_nope, v = kv.view(s, b, self.heads, self.dn + self.dv).split([self.dn, self.dv], -1)
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(s, b, self.heads, self.dr)], dim=-1)
        return query, key, v

    def _attend_latents(self, q_nope, q_rope, c, k_rope, attention_mask, kv_cache: KVCache,
                        index=None, rotary: Rotary | None = None):  # fmt: skip
        """Attention of the new positions over the cache's latents (module docstring):
        q_nope [s, b, nl, dn], q_rope [s, b, nl, dr], c [s, b, r], k_rope [s, b, 1, dr];
        index: the indexer's q, k and w, whose keys the cache keeps after the latents."""
        s, b = q_nope.shape[:2]
        kept = [c[:, :, None], k_rope] + ([] if index is None else [index[1][:, :, None]])
        latents = kv_cache.update_latent(self.layer_number, torch.cat(kept, dim=-1))
        if index is not None:  # [T, b, 1, r + dr + d]: the indexer's keys after the latents
            q_i, _, w_i = index
            scores = index_scores(q_i, latents[:, :, 0, self.r + self.dr :], w_i,
                                  relu=self.indexer.relu)  # fmt: skip
            t = scores.shape[-1]
            allowed = (torch.ones(1, s, t, dtype=torch.bool, device=scores.device)
                       if attention_mask is None else ~attention_mask[:, 0])  # fmt: skip
            chosen = self._share(rotary, chosen_positions(scores, allowed, self.topk))
            attention_mask = ~chosen[:, None]
            latents = latents[..., : self.r + self.dr]
        elif self.dsa:
            attention_mask = ~self._shared(rotary)[:, None]
        up = self.linear_kv_up_proj.weight.to(q_nope.dtype)
        w_uk, w_uv = up.view(self.heads, self.dn + self.dv, self.r).split([self.dn, self.dv], 1)
        query = torch.cat([torch.einsum("sbnd,ndr->sbnr", q_nope, w_uk), q_rope], dim=-1)
        context = self.core_attention(query, latents, latents[..., : self.r], attention_mask)
        values = torch.einsum("sbnr,nvr->sbnv", context.view(s, b, self.heads, self.r), w_uv)
        return self.linear_proj(values.reshape(s, b, self.heads * self.dv))

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces: dict[str, ShardedTensor] = {}
        for name in _SPLIT:
            if getattr(self, name) is not None:
                pieces |= getattr(self, name).sharded_state_dict(f"{prefix}{name}.")
        for name in _REPLICATED:
            if getattr(self, name) is not None:
                pieces |= replicated_state_dict(getattr(self, name), f"{prefix}{name}.",
                                                self.tp_group)  # fmt: skip
        if self.indexer is not None:  # Megatron's DSAttention is its MLA's core attention
            pieces |= replicated_state_dict(self.indexer, f"{prefix}core_attention.indexer.",
                                            self.tp_group)  # fmt: skip
        return pieces


def _allowed(attention_mask, s: int, device: torch.device) -> torch.Tensor:
    """[b or 1, s, s] bool: the positions each query may attend to, True = allowed
    (causal; within its document for a PackedSeqParams; an explicit mask's own)."""
    if attention_mask is None or isinstance(attention_mask, PackedSeqParams):
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None]
        if attention_mask is None:
            return causal
        documents = attention_mask.document_ids.to(device)
        return causal & (documents[:, :, None] == documents[:, None, :])
    return ~attention_mask[:, 0]


def _pairs_as_halves(t: torch.Tensor) -> torch.Tensor:
    """[..., dr] with rotary pairs (2i, 2i + 1) -> [..., dr] with pair i at (i, i + dr/2)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
