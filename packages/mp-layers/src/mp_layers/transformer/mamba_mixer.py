"""MambaMixer: the Mamba-2 mixer of a hybrid model's M layers (Megatron's MambaMixer,
Hugging Face's NemotronHMamba2Mixer), tensor-parallel by whole groups of heads.

Shapes: x [s, b, h] ([s/tp, b, h] with sequence parallelism); H heads of P channels
(inner width I = H P) in G groups, N the state size, K = 4 the convolution's width:

    z, x', B, C, dt = in_proj(x)        z, x' [.., I]; B, C [.., G N]; dt [.., H]
    x', B, C = silu(conv1d(x', B, C))   a causal depthwise convolution over K positions
    y = scan(x', softplus(dt + dt_bias), -exp(A_log), B, C, D)     (transformer/ssd.py)
    y = rmsnorm_g(y silu(z)) norm.weight                           one norm per group
    out = out_proj(y)

A head uses its group's B and C. The gate comes before the norm (Megatron's
norm_before_gate=False), and the norm runs over each group's H/G heads' channels.

Layout. The checkpoint holds Megatron's tensors: in_proj [2 I + 2 G N + H, h] (z, x', B,
C, dt), conv1d [I + 2 G N, K] and its bias (x', B, C), dt_bias, A_log and D [H],
norm.weight [I], out_proj [h, I]; sharded_state_dict names their parts
(in_proj.{z,x,B,C,dt}.weight, conv1d.{x,B,C}.weight and .bias) as views of the fused
local tensors, as attention does q, k and v. Here in_proj's rows and conv1d's channels
are ordered by group (each group's z, x', B, C, dt, and x', B, C), so that a tensor-
parallel rank's contiguous piece is whole groups and a seed draws the same model at
every TP size; out_proj is row-parallel. The scan runs in fp32 on each rank's heads. In
training the convolution, the scan and the gated norm keep only their inputs (the
convolution's, dt and the gate) for backward and run again there, as mamba_ssm's fused
kernel does: the scan's Q x Q blocks per chunk and head and the norm's fp32 tensors
would otherwise be most of the layer's activations. ci/bench/bench_mamba_recompute.py
(hidden 256, 2 x 1,024 tokens, this CPU): 7.8 kB a token kept instead of 72 kB in bf16
(12.5 kB instead of 79 kB in fp32), for 27-29% more forward and backward time.

Packed documents (mp_layers.PackedSeqParams; Megatron's packed sequences, its seq_idx):
each document is mixed as if alone: the convolution leaves out the taps that reach back
past a document's first position, and the scan's state restarts at 0 there (ssd.py).

Context parallelism (Megatron's MambaContextParallel): the mixer needs the whole sequence,
so an all-to-all after in_proj turns this rank's load-balanced chunks of every group into
the whole sequence, in position order, of 1/cp of the heads (context_parallel/
head_split.py: the fused in_proj output moves as [s, b, groups, rows of a group], so
each group's z, x', B, C and dt travel together); the convolution, the scan and the norm
run there with those heads' parameters, and a second all-to-all returns the output to
the rank's chunks before out_proj. With fewer groups than CP ranks a group's heads are
shared out with copies of its B and C, and its norm runs after the all-to-all back
(mamba_context_parallel.py). The parameters stay whole on every CP rank, as attention's;
each CP rank's gradient is nonzero only on its groups' slices (of in_proj and out_proj,
its tokens' share), and the gradient reduction over dp x cp that attention's weights
take combines them into the whole sequence's (test_mamba_packed_and_cp.py).

Generation: with a KVCache the convolution starts from the layer's last K - 1 inputs and
the scan from its state, both kept in the cache (kv_cache.py), so each new position costs
the same whatever came before.

Initialization, Megatron's: in_proj normal(hidden_init_std), out_proj the scaled
output-layer std; conv1d and its bias uniform(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d
default); dt_bias the inverse softplus of dt drawn log-uniformly in [0.001, 0.1] (at
least 1e-4); A_log = ln(uniform(1, 16)); D and norm.weight ones.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_hybrid import mamba_widths
from mp_layers.context_parallel.head_split import HeadSplit
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import ColumnParallelLinear, row_sharded_parameter
from mp_layers.transformer.causal_conv import causal_conv_silu
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.mamba_context_parallel import Split, check_split
from mp_layers.transformer.mlp import residual_projection
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.ssd import chunked_scan

__all__ = ["CONV_WIDTH", "SCAN_CHUNK", "MambaMixer"]

CONV_WIDTH = 4
"""K, the causal convolution's width (Megatron's d_conv)."""

SCAN_CHUNK = 128
"""Positions per chunk of the scan (Megatron's chunk_size)."""


class _Here(NamedTuple):
    """The (virtual) groups a rank mixes and their parameters (MambaMixer._here)."""

    groups: int
    per_group: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor | None
    """None: the norm runs after the all-to-all back (a group's heads span CP ranks)."""


class MambaMixer(torch.nn.Module):
    def __init__(self, config: TransformerConfig, groups: ModelGroups) -> None:
        super().__init__()
        tp = groups.tp
        self.tp_group = tp
        cp = groups.cp
        self.cp_group = cp if cp.size > 1 else None
        heads, inner = mamba_widths(config)
        self.p, self.n = config.mamba_head_dim, config.mamba_state_dim
        self.all_groups = config.mamba_num_groups
        self.groups = self.all_groups // tp.size  # on this rank
        self.per_group = heads // self.all_groups
        self.heads = self.groups * self.per_group  # on this rank
        self.eps = config.layernorm_epsilon
        wide = self.per_group * self.p
        self.unit = 2 * wide + 2 * self.n + self.per_group  # in_proj rows per group
        self.conv_unit = wide + 2 * self.n  # conv1d channels per group
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, self.all_groups * self.unit, tp_group=tp,
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
            init_method=functools.partial(torch.nn.init.normal_, std=config.hidden_init_std),
            params_dtype=config.params_dtype,
        )  # fmt: skip
        bound = 1 / math.sqrt(CONV_WIDTH)
        conv_init = functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)
        self.conv1d_weight = self._sharded((self.all_groups * self.conv_unit, CONV_WIDTH),
                                           conv_init, config.params_dtype)  # fmt: skip
        # Muon leaves these to its scalar optimizer, as Megatron does: in_proj (its rule) and
        # the depthwise convolution's kernels (Megatron's are [C, 1, width], no matrix)
        self.in_proj.weight.use_muon = False
        self.conv1d_weight.use_muon = False
        self.conv1d_bias = self._sharded((self.all_groups * self.conv_unit,), conv_init,
                                         config.params_dtype)  # fmt: skip
        self.dt_bias = self._sharded((heads,), _draw_dt_bias, config.params_dtype)
        self.A_log = self._sharded((heads,), _draw_a_log, config.params_dtype)
        self.D = self._sharded((heads,), torch.nn.init.ones_, config.params_dtype)
        self.norm_weight = self._sharded((inner,), torch.nn.init.ones_, config.params_dtype)
        self.out_proj = residual_projection(config, tp, inner)
        self.recompute = True
        """In training, keep only the convolution's inputs, dt and the gate for backward
        (module docstring); False keeps every tensor (ci/bench/bench_mamba_recompute.py's
        baseline)."""
        self.split = None
        if self.cp_group is not None:
            check_split(self.groups, self.heads, cp.size)
            self.split = Split(self.groups, self.per_group, self.p, self.n, cp.size, cp.rank)
            conv_rows, head_rows = self.split.indices()
            channels = (head_rows[:, None] * self.p + torch.arange(self.p)).flatten()
            self.register_buffer("conv_rows", conv_rows, persistent=False)
            self.register_buffer("head_rows", head_rows, persistent=False)
            self.register_buffer("channel_rows", channels, persistent=False)

    def _sharded(self, shape: tuple[int, ...], init, dtype: torch.dtype) -> torch.nn.Parameter:
        """This rank's piece (split along dimension 0) of a tensor of `shape`."""
        return row_sharded_parameter(shape, init, dtype, self.tp_group)

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0,
        packed: PackedSeqParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """x [s, b, h] (or [s/tp, b, h]) -> (output, out_proj's bias or None). With a
        kv_cache, x holds the next positions: the convolution and the scan go on from the
        cache's states of `layer` (its number in the model), which they replace. packed:
        the samples' documents, each mixed on its own (module docstring)."""
        fused, _ = self.in_proj(x)  # [s, b, groups * unit]
        s, b = fused.shape[:2]
        fused = fused.view(s, b, self.groups, self.unit)
        if (kv_cache is not None) and (packed is not None or self.cp_group is not None):
            raise ValueError(
                "MambaMixer with a KVCache (generation) takes neither packed documents nor "
                "context parallelism"
            )
        heads = None
        if self.split is not None:
            order = None if packed is None else packed.order
            heads = HeadSplit(s, b, self.cp_group, x.device, order)
            # [cp s, b, virtual groups / cp, virtual unit], in position order
            fused = heads.to_heads(self.split.spread(fused))
        documents, positions = self._documents(packed, fused.shape[:2])
        here = self._here()
        length = fused.shape[0]
        g, hg, p, n = here.groups, here.per_group, self.p, self.n
        z, xs, B, C, dt = fused.split([hg * p, hg * p, n, n, hg], dim=-1)
        xbc = torch.cat([xs, B, C], dim=-1).reshape(length, b, -1).permute(1, 2, 0)
        dt = dt.float().reshape(length, b, g * hg).transpose(0, 1)
        dt = F.softplus(dt + here.dt_bias.float())
        history = initial = None
        if kv_cache is not None:
            # Padding slots: no input to the convolution, and a step of 0 (no decay, no
            # input) that leaves the scan's state as it was.
            padded = kv_cache.padded(s, x.device)
            xbc = xbc.masked_fill(padded[:, None, :], 0)
            dt = dt.masked_fill(padded[..., None], 0)
            history, initial = kv_cache.mamba_states(layer) or (None, None)
        if history is None:
            history = xbc.new_zeros(b, xbc.shape[1], CONV_WIDTH - 1)
        inputs = torch.cat([history, xbc], dim=-1)  # [b, channels, K - 1 + s]
        A = -torch.exp(here.A_log.float())
        args = (inputs, dt, A, z, initial, here, positions, documents)
        if self.recompute and self.training and torch.is_grad_enabled():
            # As mamba_ssm's fused kernel: keep the convolution's inputs, dt and the gate,
            # and compute the convolution, the scan's chunks and the norm again in backward.
            y, state = torch.utils.checkpoint.checkpoint(self._mix, *args, use_reentrant=False)
        else:
            y, state = self._mix(*args)
        if kv_cache is not None:
            kv_cache.set_mamba_states(layer, inputs[..., -(CONV_WIDTH - 1) :], state)
        y = y.transpose(0, 1)  # [length, b, g, hg p]
        if heads is not None:
            y = heads.to_sequence(y)
        if here.norm_weight is None:  # the gated output, normalized per group here
            y = self._norm(y.reshape(s, b, self.groups, -1), self.norm_weight).to(z.dtype)
        return self.out_proj(y.reshape(s, b, -1))

    def _documents(
        self, packed: PackedSeqParams | None, shape: torch.Size
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(document ids, positions within the documents) [b, length] of the whole samples
        the mixer runs over (length = cp x s), in position order; None without packing."""
        if packed is None:
            return None, None
        whole = packed.whole()
        length, b = shape
        if tuple(whole.document_ids.shape) != (b, length):
            raise ValueError(
                f"document_ids of shape {tuple(whole.document_ids.shape)} for a Mamba mixer "
                f"over {b} samples of {length} positions"
            )
        return whole.document_ids, whole.positions

    def _here(self) -> _Here:
        """The parameters of the groups this rank mixes: all of its own, or with context
        parallelism those of its CP rank's virtual groups (mamba_context_parallel.py)."""
        if self.split is None:
            return _Here(self.groups, self.per_group, self.conv1d_weight, self.conv1d_bias,
                         self.dt_bias, self.A_log, self.D, self.norm_weight)  # fmt: skip
        split, heads = self.split, self.head_rows
        norm = None if split.norm_after else self.norm_weight[self.channel_rows]
        return _Here(split.here, split.hv, self.conv1d_weight[self.conv_rows],
                     self.conv1d_bias[self.conv_rows], self.dt_bias[heads], self.A_log[heads],
                     self.D[heads], norm)  # fmt: skip

    def _mix(
        self, inputs: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, z: torch.Tensor,
        initial: torch.Tensor | None, here: _Here, positions: torch.Tensor | None,
        documents: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The convolution's inputs [b, channels, K - 1 + s], dt [b, s, heads], the gate z
        [s, b, groups, hg p] -> the gated, normalized scan output [b, s, groups, hg p] in
        z's dtype (gated only, in fp32, when here.norm_weight is None), and the scan's
        final state (fp32)."""
        b, s = dt.shape[:2]
        g, hg, p, n = here.groups, here.per_group, self.p, self.n
        xbc = causal_conv_silu(inputs, here.conv_weight, here.conv_bias, positions)
        xs, B, C = xbc.view(b, s, g, hg * p + 2 * n).split([hg * p, n, n], dim=-1)
        y, state = chunked_scan(xs.reshape(b, s, g * hg, p), dt, A, B, C, here.D, SCAN_CHUNK,
                                initial, documents)  # fmt: skip
        gated = y.reshape(b, s, g, hg * p) * F.silu(z.transpose(0, 1).float())
        if here.norm_weight is None:
            return gated, state
        return self._norm(gated, here.norm_weight).to(z.dtype), state

    def _norm(self, gated: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS norm per group of the gated output [.., groups, hg p] (fp32) times `weight`
        (the norm weight of those groups' channels)."""
        gated = gated.float()
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * weight.float().view(gated.shape[-2], -1)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """Megatron's logical tensors (module docstring), each part of in_proj and conv1d a
        view [G, rows of a group, ...] of the local fused tensor (Megatron's [G x rows, ...]
        in the same order), at this rank's first group."""
        pieces = self.out_proj.sharded_state_dict(f"{prefix}out_proj.")
        rank, tp = self.tp_group.rank, self.tp_group.size
        g, hg, p, n = self.groups, self.per_group, self.p, self.n
        rows = {"z": hg * p, "x": hg * p, "B": n, "C": n, "dt": hg}
        fused = (("in_proj", "weight", self.in_proj.weight, "zxBCd", self.unit),
                 ("in_proj", "bias", self.in_proj.bias, "zxBCd", self.unit),
                 ("conv1d", "weight", self.conv1d_weight, "xBC", self.conv_unit),
                 ("conv1d", "bias", self.conv1d_bias, "xBC", self.conv_unit))  # fmt: skip
        for module, kind, local, parts, unit in fused:
            if local is None:
                continue
            tail = tuple(local.shape[1:])
            grouped = local.view(g, unit, *tail)
            start = 0
            for part in ("dt" if c == "d" else c for c in parts):
                data = grouped[:, start : start + rows[part]]
                start += rows[part]
                key = f"{prefix}{module}.{part}.{kind}"
                offset = (rank * g,) + (0,) * (data.dim() - 1)
                pieces[key] = ShardedTensor(key, data, (g * tp, *data.shape[1:]), offset)
        for name, local in (("dt_bias", self.dt_bias), ("A_log", self.A_log), ("D", self.D),
                            ("norm.weight", self.norm_weight)):  # fmt: skip
            key = prefix + name
            pieces[key] = ShardedTensor.from_rank(key, local, 0, rank, tp)
        return pieces


def _draw_dt_bias(t: torch.Tensor) -> torch.Tensor:
    """softplus^-1(dt), dt log-uniform in [0.001, 0.1] and at least 1e-4 (Megatron's)."""
    low, high = math.log(0.001), math.log(0.1)
    with torch.no_grad():
        dt = torch.exp(torch.rand_like(t) * (high - low) + low).clamp(min=1e-4)
        return t.copy_(dt + torch.log(-torch.expm1(-dt)))


def _draw_a_log(t: torch.Tensor) -> torch.Tensor:
    """ln(A) for A uniform in [1, 16] (Megatron's A_init_range)."""
    with torch.no_grad():
        return t.copy_(torch.log(torch.empty_like(t).uniform_(1, 16)))
