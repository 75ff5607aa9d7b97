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

Generation: with a KVCache the convolution starts from the layer's last K - 1 inputs and
the scan from its state, both kept in the cache (kv_cache.py), so each new position costs
the same whatever came before.

Initialization, Megatron's: in_proj normal(init_method_std), out_proj the scaled
output-layer std; conv1d and its bias uniform(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d
default); dt_bias the inverse softplus of dt drawn log-uniformly in [0.001, 0.1] (at
least 1e-4); A_log = ln(uniform(1, 16)); D and norm.weight ones.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_hybrid import mamba_widths
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import ColumnParallelLinear, init_partitioned_weight
from mp_layers.tensor_parallel.deferred_init import weight_device
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.mlp import residual_projection
from mp_layers.transformer.ssd import chunked_scan

__all__ = ["CONV_WIDTH", "SCAN_CHUNK", "MambaMixer"]

CONV_WIDTH = 4
"""K, the causal convolution's width (Megatron's d_conv)."""

SCAN_CHUNK = 128
"""Positions per chunk of the scan (Megatron's chunk_size)."""


class MambaMixer(torch.nn.Module):
    def __init__(self, config: TransformerConfig, groups: ModelGroups) -> None:
        super().__init__()
        tp = groups.tp
        self.tp_group = tp
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
            init_method=functools.partial(torch.nn.init.normal_, std=config.init_method_std),
            params_dtype=config.params_dtype,
        )  # fmt: skip
        bound = 1 / math.sqrt(CONV_WIDTH)
        conv_init = functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)
        self.conv1d_weight = self._sharded((self.all_groups * self.conv_unit, CONV_WIDTH),
                                           conv_init, config.params_dtype)  # fmt: skip
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

    def _sharded(self, shape: tuple[int, ...], init, dtype: torch.dtype) -> torch.nn.Parameter:
        """This rank's piece (split along dimension 0) of a tensor of `shape`."""
        local = (shape[0] // self.tp_group.size, *shape[1:])
        param = torch.nn.Parameter(torch.empty(local, dtype=dtype, device=weight_device(None)))
        init_partitioned_weight(param, shape, 0, self.tp_group, init)
        return param

    def forward(
        self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [s, b, h] (or [s/tp, b, h]) -> (output, out_proj's bias or None). With a
        kv_cache, x holds the next positions: the convolution and the scan go on from the
        cache's states of `layer` (its number in the model), which they replace."""
        fused, _ = self.in_proj(x)  # [s, b, groups * unit]
        s, b = fused.shape[:2]
        g, hg, p, n = self.groups, self.per_group, self.p, self.n
        z, xs, B, C, dt = fused.view(s, b, g, self.unit).split([hg * p, hg * p, n, n, hg], dim=-1)
        xbc = torch.cat([xs, B, C], dim=-1).reshape(s, b, g * self.conv_unit).permute(1, 2, 0)
        dt = F.softplus(dt.float().reshape(s, b, self.heads).transpose(0, 1) + self.dt_bias.float())
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
        A = -torch.exp(self.A_log.float())
        if self.recompute and self.training and torch.is_grad_enabled():
            # As mamba_ssm's fused kernel: keep the convolution's inputs, dt and the gate,
            # and compute the convolution, the scan's chunks and the norm again in backward.
            y, state = torch.utils.checkpoint.checkpoint(
                self._mix, inputs, dt, A, z, initial, use_reentrant=False
            )
        else:
            y, state = self._mix(inputs, dt, A, z, initial)
        if kv_cache is not None:
            kv_cache.set_mamba_states(layer, inputs[..., -(CONV_WIDTH - 1) :], state)
        return self.out_proj(y.reshape(b, s, -1).transpose(0, 1))

    def _mix(
        self, inputs: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, z: torch.Tensor,
        initial: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The convolution's inputs [b, channels, K - 1 + s], dt [b, s, heads], the gate z
        [s, b, groups, hg p] -> the gated, normalized scan output [b, s, groups, hg p] in
        z's dtype, and the scan's final state (fp32)."""
        b, s = dt.shape[:2]
        g, hg, p, n = self.groups, self.per_group, self.p, self.n
        xbc = self._convolve(inputs)
        xs, B, C = xbc.view(b, s, g, self.conv_unit).split([hg * p, n, n], dim=-1)
        y, state = chunked_scan(xs.reshape(b, s, self.heads, p), dt, A, B, C, self.D,
                                SCAN_CHUNK, initial)  # fmt: skip
        y = self._gated_norm(y.reshape(b, s, g, hg * p), z.transpose(0, 1))
        return y.to(z.dtype), state

    def _convolve(self, inputs: torch.Tensor) -> torch.Tensor:
        """[b, channels, K - 1 + s] (the K - 1 earlier inputs first) -> silu of the causal
        depthwise convolution at the s new positions, [b, s, channels]."""
        out = F.conv1d(
            inputs, self.conv1d_weight.to(inputs.dtype)[:, None, :],
            self.conv1d_bias.to(inputs.dtype), groups=inputs.shape[1],
        )  # fmt: skip
        return F.silu(out).transpose(1, 2)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm per group of y silu(z) (fp32) times norm_weight: [b, s, g, hg p]."""
        gated = y.float() * F.silu(z.float())
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.norm_weight.float().view(self.groups, -1)

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
