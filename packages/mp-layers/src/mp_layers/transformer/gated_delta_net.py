"""GatedDeltaNet: the linear attention of Qwen3-Next's layers (Megatron's GatedDeltaNet,
experimental_attention_variant "gdn"; Hugging Face's Qwen3NextGatedDeltaNet), tensor-parallel
by whole key heads. It stands where a layer's self-attention would, built and called alike.

Shapes: x [s, b, h] ([s/tp, b, h] with sequence parallelism); Hk query/key heads of dk
channels, Hv = r Hk value heads of dv channels (each key head serves r consecutive value
heads), K the convolution's width (linear_conv_kernel_dim):

    q, k, v, z, beta, alpha = in_proj(x)     q, k [.., Hk dk]; v, z [.., Hv dv]; beta,
                                             alpha [.., Hv]
    q, k, v = silu(conv1d(q, k, v))          a causal depthwise convolution over K positions
    q, k = l2norm(q), l2norm(k)              per head (eps 1e-6, as FLA's and transformers')
    g = -exp(A_log) softplus(alpha + dt_bias)          the log-decay, fp32
    o = delta_rule(q, k, v, g, sigmoid(beta))          delta_rule.py, per value head, fp32
    o = out_norm(o) silu(z)                  an RMS norm per value head over its dv channels
    out = out_proj(o)

Layout. The checkpoint holds Megatron's logical tensors (no biases, as Megatron's layer has
none): in_proj.{query,key,value,z,beta,alpha}.weight, conv1d.{query,key,value}.weight, each a
view [Hk, rows of one key head, ...] of the fused local tensor; dt_bias and A_log [Hv];
out_norm.weight [dv]; out_proj [h, Hv dv]. Here in_proj's rows and conv1d's channels are
ordered by key head (each key head's q, k, v, z, beta, alpha rows; its q, k, v channels), so
a tensor-parallel rank's contiguous piece is whole key heads with their value heads, and a
seed draws the same model at every TP size. out_norm's weight is shared by every head: its
gradient is a partial sum on each TP rank, marked (`sequence_parallel`) for the all-reduce
over the TP group that mp-pipeline's finalize step gives norms.

Packed documents (an attention_mask that is a PackedSeqParams): each document is mixed as if
alone (the convolution's taps and the state stop at its first position). Generation: with a
KVCache the convolution starts from the layer's last K - 1 inputs and the rule from its
state, both kept in the cache (kv_cache.py's mamba states), padding slots leaving them as
they were.

Memory: in training the layer keeps for backward only the convolution's inputs, the gates
(g and beta, fp32) and z, and computes the convolution, the rule's chunks and the gated
norm again in backward (torch.utils.checkpoint), as FLA's chunked kernel keeps only its
inputs and the chunks' states: the rule's C x C products per chunk and head would
otherwise be most of the layer's activations. ci/bench/bench_gdn_recompute.py (h 512, 8
key and 16 value heads of 64, 1,024 tokens, one thread of this CPU): 25.0 kB a token kept
instead of 135.8 kB in fp32 (12.6 instead of 113.2 in bf16), for 1.24x the forward and
backward time in fp32 (best of 3: 731 ms against 591). mp_train.estimate.linear_attention
counts what it keeps (checked against the saved tensors in tests/test_estimate_families.py).

Context parallelism (Megatron's): the rule needs the whole sequence, so an all-to-all after
in_proj turns this rank's load-balanced chunks of every key head into the whole sequence,
in position order, of 1/cp of the key heads (context_parallel/head_split.py; in_proj's
output moves as [s, b, key heads, rows of a key head], so each head's q, k, v, z, beta and
alpha travel together); the convolution, the rule and the gated norm run there with those
heads' parameters, and a second all-to-all returns the output to the rank's chunks before
out_proj. linear_num_key_heads must divide by tp x cp (Megatron's rule). The parameters
stay whole on every CP rank; each CP rank's gradient holds its heads' share, which the
gradient reduction over dp x cp sums, as for the Mamba mixers.

Initialization, Megatron's: in_proj normal(hidden_init_std), out_proj the scaled output-layer
std; conv1d uniform(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d default); dt_bias ones; A_log =
ln(uniform(1, 16)); out_norm ones (zeros with apply_layernorm_1p).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.context_parallel.head_split import HeadSplit
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    replicated_state_dict,
    row_sharded_parameter,
)
from mp_layers.transformer.causal_conv import causal_conv_silu
from mp_layers.transformer.delta_rule import chunked_delta_rule
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.rope import Rotary
from mp_state import RNGStatesTracker

if TYPE_CHECKING:
    from mp_layers.transformer.spec import LayerSpec

__all__ = ["DELTA_CHUNK", "L2_EPS", "GatedDeltaNet"]

DELTA_CHUNK = 64
"""Positions per chunk of the delta rule (Megatron's chunk_size)."""

L2_EPS = 1e-6
"""The L2 norm of queries and keys: x / sqrt(sum(x^2) + eps) (FLA's and transformers')."""

_PARTS = ("query", "key", "value", "z", "beta", "alpha")
_CONV_PARTS = ("query", "key", "value")


class GatedDeltaNet(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        *,
        spec: LayerSpec,
        layer_number: int = 0,
    ) -> None:
        super().__init__()
        tp = groups.tp
        config.check_parallel(tp.size, groups.cp.size)
        self.tp_group = tp
        self.cp_group = groups.cp if groups.cp.size > 1 else None
        self.layer_number = layer_number
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.all_heads = config.linear_num_key_heads
        self.heads = self.all_heads // tp.size  # key heads on this rank
        self.r = config.linear_num_value_heads // config.linear_num_key_heads
        self.width = config.linear_conv_kernel_dim
        self.rows = {"query": self.dk, "key": self.dk, "value": self.r * self.dv,
                     "z": self.r * self.dv, "beta": self.r, "alpha": self.r}  # fmt: skip
        self.unit = sum(self.rows.values())  # in_proj rows per key head
        self.conv_unit = 2 * self.dk + self.r * self.dv  # conv1d channels per key head
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, self.all_heads * self.unit, tp_group=tp,
            bias=False, sequence_parallel=config.sequence_parallel,
            init_method=functools.partial(torch.nn.init.normal_, std=config.hidden_init_std),
            params_dtype=config.params_dtype,
        )  # fmt: skip
        bound = 1 / math.sqrt(self.width)
        conv_init = functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)
        self.conv1d_weight = self._sharded((self.all_heads * self.conv_unit, self.width),
                                           conv_init, config.params_dtype)  # fmt: skip
        # a depthwise convolution's kernels, not a matrix (Megatron's is [C, 1, width]):
        # Muon leaves it to its scalar optimizer
        self.conv1d_weight.use_muon = False
        value_heads = config.linear_num_value_heads
        self.dt_bias = self._sharded((value_heads,), torch.nn.init.ones_, config.params_dtype)
        self.A_log = self._sharded((value_heads,), _draw_a_log, config.params_dtype)
        self.out_norm = spec.norm(config, self.dv)
        for param in self.out_norm.parameters():  # a partial sum on each TP rank's heads
            param.sequence_parallel = True
        self.recompute = True
        """In training, keep only the convolution's inputs, the gates and z for backward and
        compute the convolution, the rule and the gated norm again there (module
        docstring); False keeps every tensor."""
        self.out_proj = RowParallelLinear(
            value_heads * self.dv, config.hidden_size, tp_group=tp, bias=False,
            input_is_parallel=True, skip_bias_add=True, sequence_parallel=config.sequence_parallel,
            init_method=functools.partial(torch.nn.init.normal_, std=config.output_layer_init_std),
            params_dtype=config.params_dtype,
        )  # fmt: skip

    def _sharded(self, shape: tuple[int, ...], init, dtype: torch.dtype) -> torch.nn.Parameter:
        """This rank's piece (split along dimension 0) of a tensor of `shape`."""
        return row_sharded_parameter(shape, init, dtype, self.tp_group)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [s, b, h] -> (output, out_proj's bias or None). rotary and a causal mask do not
        concern it; a PackedSeqParams gives the documents; with a kv_cache, x holds the next
        positions and the layer goes on from the cache's states, which it replaces."""
        packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
        if kv_cache is not None and (packed is not None or self.cp_group is not None):
            raise ValueError("GatedDeltaNet with a KVCache (generation) takes neither packed "
                             "documents nor context parallelism")  # fmt: skip
        fused, _ = self.in_proj(x)  # [s, b, heads * unit]
        s, b = fused.shape[:2]
        fused = fused.view(s, b, self.heads, self.unit)
        heads = None
        if self.cp_group is not None:  # the whole sequence of 1/cp of the key heads
            heads = HeadSplit(
                s, b, self.cp_group, x.device, None if packed is None else packed.order
            )
            fused = heads.to_heads(fused)
        length, hk = fused.shape[0], fused.shape[2]  # here
        conv_weight, A_log, dt_bias = self._here(hk)
        r, dv = self.r, self.dv
        q, k, v, z, beta, alpha = fused.split([self.rows[p] for p in _PARTS], dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).reshape(length, b, -1).permute(1, 2, 0)  # [b, ch, L]
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        g = -A_log.to(wide).exp() * F.softplus(
            alpha.to(wide).reshape(length, b, -1) + dt_bias.to(wide)
        )
        beta = beta.to(wide).reshape(length, b, -1).sigmoid()
        g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [b, L, value heads]
        history = initial = documents = positions = None
        if kv_cache is not None:
            padded = kv_cache.padded(s, x.device)  # [b, s]: no input, no decay, no write
            qkv = qkv.masked_fill(padded[:, None, :], 0)
            g, beta = g.masked_fill(padded[..., None], 0), beta.masked_fill(padded[..., None], 0)
            history, initial = kv_cache.mamba_states(self.layer_number) or (None, None)
        if packed is not None:  # the whole samples' documents, in position order
            whole = packed.whole()
            positions, documents = whole.positions, whole.document_ids
        if history is None:
            history = qkv.new_zeros(b, qkv.shape[1], self.width - 1)
        inputs = torch.cat([history, qkv], dim=-1)
        args = (inputs, conv_weight, g, beta, z, initial, positions, documents)
        if self.recompute and self.training and torch.is_grad_enabled():
            # keep the convolution's inputs, the gates and z; compute the convolution, the
            # rule's chunks and the gated norm again in backward
            out, state = torch.utils.checkpoint.checkpoint(self._mix, *args, use_reentrant=False)
        else:
            out, state = self._mix(*args)
        if kv_cache is not None:
            kv_cache.set_mamba_states(self.layer_number, inputs[..., -(self.width - 1) :], state)
        out = out.transpose(0, 1).reshape(length, b, hk, r * dv)
        if heads is not None:
            out = heads.to_sequence(out)
        return self.out_proj(out.reshape(s, b, -1))

    def _mix(
        self, inputs: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, z: torch.Tensor, initial: torch.Tensor | None,
        positions: torch.Tensor | None, documents: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The convolution's inputs [b, channels, K - 1 + L], the gates g and beta [b, L,
        value heads] (fp32), z [L, b, key heads, r dv] -> the gated, normalized output
        [b, L, value heads, dv] in z's dtype, and the rule's final state."""
        b, length = g.shape[:2]
        hk, r, dk, dv = z.shape[2], self.r, self.dk, self.dv
        wide = g.dtype
        mixed = causal_conv_silu(inputs, conv_weight, None, positions)  # [b, L, channels]
        q, k, v = mixed.view(b, length, hk, self.conv_unit).split([dk, dk, r * dv], dim=-1)
        q, k = (_l2norm(t.to(wide)).repeat_interleave(r, dim=2) for t in (q, k))
        v = v.reshape(b, length, hk * r, dv)
        out, state = chunked_delta_rule(q, k, v, g, beta, DELTA_CHUNK, initial, documents)
        gate = F.silu(z.to(wide)).transpose(0, 1).reshape(b, length, hk * r, dv)
        return (self.out_norm(out.to(z.dtype)).to(wide) * gate).to(z.dtype), state

    def _here(self, hk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv1d's weight, A_log and dt_bias of the hk key heads this rank mixes: all of
        its own, or with context parallelism its CP rank's share of them."""
        if self.cp_group is None:
            return self.conv1d_weight, self.A_log, self.dt_bias
        first = self.cp_group.rank * hk
        conv = self.conv1d_weight.view(self.heads, self.conv_unit, -1)[first : first + hk]
        values = slice(first * self.r, (first + hk) * self.r)
        return conv.reshape(-1, self.width), self.A_log[values], self.dt_bias[values]

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """Megatron's logical tensors (module docstring), each part of in_proj and conv1d a
        view [Hk, rows of a key head, ...] of the local fused tensor, at this rank's first
        key head."""
        pieces = self.out_proj.sharded_state_dict(f"{prefix}out_proj.")
        rank, tp, hk = self.tp_group.rank, self.tp_group.size, self.heads
        conv_rows = {p: self.rows[p] for p in _CONV_PARTS}
        fused = (("in_proj", "weight", self.in_proj.weight, self.rows, self.unit),
                 ("conv1d", "weight", self.conv1d_weight, conv_rows, self.conv_unit))  # fmt: skip
        for module, kind, local, rows, unit in fused:
            grouped = local.view(hk, unit, *local.shape[1:])
            start = 0
            for part, count in rows.items():
                data = grouped[:, start : start + count]
                start += count
                key = f"{prefix}{module}.{part}.{kind}"
                offset = (rank * hk,) + (0,) * (data.dim() - 1)
                pieces[key] = ShardedTensor(key, data, (hk * tp, *data.shape[1:]), offset)
        for name, local in (("dt_bias", self.dt_bias), ("A_log", self.A_log)):
            pieces[prefix + name] = ShardedTensor.from_rank(prefix + name, local, 0, rank, tp)
        return pieces | replicated_state_dict(self.out_norm, f"{prefix}out_norm.", self.tp_group)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def _draw_a_log(t: torch.Tensor) -> torch.Tensor:
    """ln(A) for A uniform in [1, 16] (Megatron's A_init_range)."""
    with torch.no_grad():
        return t.copy_(torch.log(torch.empty_like(t).uniform_(1, 16)))
