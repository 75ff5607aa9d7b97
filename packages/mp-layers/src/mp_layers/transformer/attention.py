"""Self-attention with a fused QKV projection in Megatron's per-group layout.

Shapes: x [s, b, h]; ng query groups (key/value heads), qg = heads per group,
d = kv_channels. The QKV weight is [ng * (qg + 2) * d, h]; group by group it
holds qg query heads, then the group's key head, then its value head. A
column split over the TP group therefore gives each rank ng/tp whole groups,
and the layout (hence the model) does not depend on the TP size. With fewer groups
than TP ranks, each group is shared by tp/ng ranks (shared_query_groups.py).
sharded_state_dict describes q, k and v as logical tensors
[ng, qg, d, h], [ng, d, h], [ng, d, h] (strided views of the fused weight),
so that checkpoints and conversions never see the fused layout. With
attention_output_gate (Megatron's; Qwen3-Next) each group also holds qg gate heads after
its query heads (gate [ng, qg, d, h]), and attention's output [s, b, heads d] is
multiplied by sigmoid(gate) before linear_proj.

With softmax_type "learnable", core attention's softmax_offset [heads on this rank]
(Megatron's name) is split over the TP group with the heads and described as
core_attention.softmax_offset [num_attention_heads]. A layer that
TransformerConfig.window_size applies to (window_layer_pattern) attends through the
window; with a KVCache such a layer keeps only its window's latest keys
(KVCache.update_window), and its mask is the cache's for them; with window_rotary_base it
rotates with Rotary.window, plain RoPE of that base.

Rotary embeddings rotate q and k after the QK norm (Megatron's order; an L2 norm, having
no weight, commutes with the rotation, so Llama 4's rotate-then-normalize is the same),
in the pairs rotary_interleaved says, on the layers no_rope_freq leaves them
(rope_layer_pattern). qk_l2_norm's norm holds no weights: nothing enters the checkpoint.
The query and key norms' weights are shared by every head, so at TP > 1 each rank's
gradient is a partial sum over its heads: they are marked `sequence_parallel`, which has
mp-pipeline's finalize step sum them over the TP group, with or without sequence
parallelism. With qk_layernorm_scope "all_heads" (OLMo 2's) they normalize each
position's queries, and its keys, over all heads together (all_heads_norm.py), a weight
per channel split over the TP group with the heads.
Llama 4's rotary layers attend within blocks of attention_chunk_size positions
(chunked_attention.py; with a KVCache through the cache's block mask), and its other
layers' queries take Rotary.query_scale (attn_temperature_floor_scale); with
query_log_scale_beta (Ministral 3's) the rotating layers' queries take
Rotary.rotated_query_scale after their rotation.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_attention import (
    qk_l2_norm_layer_pattern,
    rope_layer_pattern,
    window_layer_pattern,
)
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    init_partitioned_weight,
    replicated_state_dict,
)
from mp_layers.transformer.all_heads_norm import AllHeadsRMSNorm
from mp_layers.transformer.chunked_attention import attend_in_blocks, block_mask
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.mlp import residual_projection
from mp_layers.transformer.norms import L2Norm
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.recompute import checkpointed
from mp_layers.transformer.rope import Rotary, apply_rotary_pos_emb
from mp_layers.transformer.shared_query_groups import SharedGroup
from mp_state import RNGStatesTracker

if TYPE_CHECKING:
    from mp_layers.transformer.spec import LayerSpec

__all__ = ["SelfAttention", "layer_scaling"]


def layer_scaling(config: TransformerConfig, layer_number: int) -> dict[str, int]:
    """Core attention's score_divisor under apply_query_key_layer_scaling: the layer's
    number, 1-based as Megatron-LM counts (layer_number: the 0-based index); nothing
    otherwise, so that a spec's own core attention need not take it."""
    if not config.apply_query_key_layer_scaling:
        return {}
    return {"score_divisor": layer_number + 1}


class SelfAttention(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        *,
        spec: LayerSpec,
        layer_number: int = 0,
    ) -> None:
        """spec: the layer's (its norm and core attention); layer_number: the layer's index
        in the whole model (its place in a KVCache)."""
        super().__init__()
        self.layer_number = layer_number
        tp_group = groups.tp
        config.check_parallel(tp_group.size, groups.cp.size)
        self.tp_group = tp_group
        self.d = config.kv_channels
        ng, tp = config.num_query_groups, tp_group.size
        self.gated = config.attention_output_gate
        # fewer groups than ranks: each group shared by tp / ng ranks (shared_query_groups.py)
        self.shared = None
        if ng < tp:
            self.shared = SharedGroup(ng, config.num_attention_heads // ng, self.gated, self.d,
                                      tp, tp_group.rank)  # fmt: skip
        self.groups = 1 if self.shared else ng // tp  # on this rank
        self.per_group = config.num_attention_heads // tp // self.groups  # on this rank
        self.gates = self.per_group if self.gated else 0  # gate heads per group
        width = ng * (config.num_attention_heads // ng * (2 if self.gated else 1) + 2) * self.d
        draw = functools.partial(torch.nn.init.normal_, std=config.hidden_init_std)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, width, tp_group=tp_group,
            bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=config.sequence_parallel,
            init_method=self.shared.init_method(draw) if self.shared else draw,
            params_dtype=config.params_dtype,
        )  # fmt: skip
        # the rows of each part in one query group on this rank: q, [gate,] k, v (Muon
        # orthogonalizes them apart, as Megatron's --muon-split-qkv does)
        parts = (self.per_group, self.gates, 1, 1) if self.gated else (self.per_group, 1, 1)
        rows = tuple(n * self.d for n in parts)
        self.linear_qkv.weight.qkv_rows = self.shared.rows if self.shared else rows
        self.rotates = rope_layer_pattern(config)[layer_number]
        self.interleaved = config.rotary_interleaved
        self.chunk = config.attention_chunk_size if self.rotates else None
        self.cp_size = groups.cp.size
        if config.qk_l2_norm:  # replaces qk_layernorm (Megatron's precedence); no weights
            l2 = qk_l2_norm_layer_pattern(config)[layer_number]
            self.q_layernorm = L2Norm(config.layernorm_epsilon) if l2 else None
            self.k_layernorm = self.q_layernorm
        elif config.qk_layernorm and config.qk_layernorm_scope == "all_heads":
            self.q_layernorm, self.k_layernorm = (
                AllHeadsRMSNorm(n // tp * self.d, n * self.d, config.layernorm_epsilon, tp_group,
                                one_p=config.apply_layernorm_1p,
                                params_dtype=config.params_dtype)
                for n in (config.num_attention_heads, ng)
            )  # fmt: skip
        else:
            self.q_layernorm = spec.norm(config, self.d) if config.qk_layernorm else None
            self.k_layernorm = spec.norm(config, self.d) if config.qk_layernorm else None
            for norm in (self.q_layernorm, self.k_layernorm):
                for param in norm.parameters() if norm is not None else ():
                    # shared by every head, each TP rank's heads giving a partial sum: summed
                    # over TP with the sequence-parallel norms' (Megatron sums them by name)
                    param.sequence_parallel = True
        windowed = window_layer_pattern(config)[layer_number]
        self.window = config.window_size[0] if windowed else None
        self.core_attention = spec.core_attention(
            config.attention_dropout, rng_tracker, config.attention_backend,
            cp_group=groups.cp, cp_comm_type=config.cp_comm_type, cp_levels=groups.cp_levels,
            track_max_logits=config.tracks_max_attention_logit,
            softmax_type=config.softmax_type, window=self.window,
            heads=self.groups * self.per_group, params_dtype=config.params_dtype,
            softmax_scale=config.softmax_scale,  # muP's or Gemma's; None: 1 / sqrt(d)
            **layer_scaling(config, layer_number),
        )  # fmt: skip
        if config.softmax_type == "learnable":  # the same sinks whatever the TP size
            init_partitioned_weight(
                self.core_attention.softmax_offset, (config.num_attention_heads,), 0, tp_group,
                functools.partial(torch.nn.init.normal_, std=config.hidden_init_std),
            )  # fmt: skip
        # Selective recompute (Korthikanti et al.): core attention's activations grow with
        # s^2 but cost little to recompute, so only they are recomputed in backward.
        self.recompute_core_attention = config.recomputes("core_attn")
        self.rng_tracker = rng_tracker
        self.linear_proj = residual_projection(
            config, tp_group, config.num_attention_heads * self.d
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [s, b, h] -> (output [s, b, h], projection bias or None). With a kv_cache, x
        holds the next positions only: their keys and values join the cache's, and the
        queries attend to all of them (attention_mask: the cache's)."""
        if rotary is not None and rotary.window is not None and self.window is not None:
            rotary = rotary.window  # the windowed layers' own (window_rotary_base)
        mixed, _ = self.linear_qkv(x)
        s, b = mixed.shape[:2]
        qg, gates = self.per_group, self.gates
        if self.shared:
            q, gate, k, v = self.shared.split(mixed, self.tp_group)
        else:
            mixed = mixed.view(s, b, self.groups, qg + gates + 2, self.d)
            q = mixed[:, :, :, :qg].reshape(s, b, self.groups * qg, self.d)
            gate = mixed[:, :, :, qg : qg + gates].reshape(s, b, -1) if self.gated else None
            k = mixed[:, :, :, qg + gates]
            v = mixed[:, :, :, qg + gates + 1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None and self.rotates:
            q = apply_rotary_pos_emb(q, rotary, self.interleaved)
            k = apply_rotary_pos_emb(k, rotary, self.interleaved)
            if rotary.rotated_query_scale is not None:  # Ministral 3's query_log_scale_beta
                q = (q * rotary.rotated_query_scale).to(q.dtype)
        elif rotary is not None and rotary.query_scale is not None:  # Llama 4's temperature
            q = (q * rotary.query_scale).to(q.dtype)
        if kv_cache is not None and self.window is None:
            k, v = kv_cache.update(self.layer_number, k, v)
            if self.chunk is not None:
                attention_mask = kv_cache.chunked_attention_mask(s, self.chunk, q.device)
        elif kv_cache is not None:  # the layer's ring of recent keys, with its own mask
            k, v, attention_mask = kv_cache.update_window(self.layer_number, k, v, self.window)
        attend = self.core_attention
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            attend = functools.partial(checkpointed, self.core_attention, self.rng_tracker)
        if self.chunk is not None and kv_cache is None and s * self.cp_size > self.chunk:
            out = self._attend_in_blocks(attend, q, k, v, attention_mask)
        else:
            out = attend(q, k, v, attention_mask)
        if gate is not None:  # Megatron's output gate, in fp32
            out = (out.float() * torch.sigmoid(gate.float())).to(out.dtype)
        return self.linear_proj(out)

    def _attend_in_blocks(self, attend, q, k, v, attention_mask) -> torch.Tensor:
        """Chunked attention (chunked_attention.py) over a sequence longer than a block."""
        if self.cp_size > 1 or isinstance(attention_mask, PackedSeqParams):
            what = "context parallelism" if self.cp_size > 1 else "packed sequences"
            raise ValueError(
                f"attention_chunk_size={self.chunk} over sequences of {q.shape[0] * self.cp_size}"
                f" positions with {what} is not implemented: use sequences of at most "
                f"{self.chunk} positions"
            )
        if attention_mask is None:
            return attend_in_blocks(lambda *qkv: attend(*qkv, None), self.chunk, q, k, v)
        positions = torch.arange(q.shape[0], device=q.device)[None]
        outside = block_mask(positions, positions, self.chunk)
        return attend(q, k, v, attention_mask | outside)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = self.linear_proj.sharded_state_dict(f"{prefix}linear_proj.")
        rank, ng = self.tp_group.rank, self.groups * self.tp_group.size
        offset = rank * self.groups
        params = {"weight": self.linear_qkv.weight, "bias": self.linear_qkv.bias}
        for name, local in params.items():
            if local is None:
                continue
            if self.shared:
                pieces |= self.shared.pieces(prefix, name, local)
                continue
            tail = tuple(local.shape[1:])  # (h,) for the weight, () for the bias
            qg, gates = self.per_group, self.gates
            fused = local.view(self.groups, qg + gates + 2, self.d, *tail)
            parts = {"q": fused[:, :qg], "k": fused[:, qg + gates], "v": fused[:, qg + gates + 1]}
            if self.gated:
                parts["gate"] = fused[:, qg : qg + gates]
            for part, data in parts.items():
                key = f"{prefix}linear_qkv.{part}.{name}"
                shape = (ng, *data.shape[1:])
                pieces[key] = ShardedTensor(key, data, shape, (offset,) + (0,) * (data.dim() - 1))
        if isinstance(self.core_attention.softmax_offset, torch.nn.Parameter):
            key = f"{prefix}core_attention.softmax_offset"
            pieces[key] = ShardedTensor.from_rank(
                key, self.core_attention.softmax_offset, 0, rank, self.tp_group.size
            )
        if isinstance(self.q_layernorm, AllHeadsRMSNorm):
            for name in ("q_layernorm", "k_layernorm"):
                pieces |= getattr(self, name).sharded_state_dict(f"{prefix}{name}.")
        elif self.q_layernorm is not None and not isinstance(self.q_layernorm, L2Norm):
            for name in ("q_layernorm", "k_layernorm"):
                pieces |= replicated_state_dict(getattr(self, name), f"{prefix}{name}.",
                                                self.tp_group)  # fmt: skip
        return pieces
