"""The MLP: fc2(act(fc1(x))), split over the tensor-parallel group.

Shapes: x [s, b, h] (or [s/tp, b, h] with sequence parallelism), the inner
activation [s, b, f/tp] on each rank, f = ffn_hidden_size. fc1 is column-
parallel, fc2 row-parallel: one reduction per direction (Megatron's MLP).

A gated activation (swiglu, geglu, quick_geglu) uses one fused fc1 holding the gate and the
up projection. Each rank computes act(gate_r x) * (up_r x) on its own f/tp channels, so its local
fc1 rows must be [gate_r; up_r]. The fused weight is initialized from the
logical [gate; up] drawn once, then laid out per rank, so that the model is
the same at every TP size, and sharded_state_dict describes gate and up as
logical tensors of their own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mp_layers.tensor_parallel.deferred_init import GatedRows
from mp_state import RankGroup

__all__ = ["MLP", "activate", "residual_projection"]


class MLP(torch.nn.Module):
    def __init__(
        self, config: TransformerConfig, tp_group: RankGroup, ffn_hidden_size: int | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.gated = config.gated_linear_unit
        self.tp_group = tp_group
        f = ffn_hidden_size or config.ffn_hidden_size
        init = functools.partial(torch.nn.init.normal_, std=config.hidden_init_std)
        fc1_init = GatedRows(init, tp_group.size) if self.gated else init
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * f if self.gated else f, tp_group=tp_group,
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
            init_method=fc1_init, params_dtype=config.params_dtype,
        )  # fmt: skip
        self.linear_fc2 = residual_projection(config, tp_group, f)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (output, fc2 bias) for the caller to add with the residual."""
        inner, _ = self.linear_fc1(x)
        return self.linear_fc2(activate(self.config, inner))

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = self.linear_fc2.sharded_state_dict(f"{prefix}linear_fc2.")
        if not self.gated:
            return pieces | self.linear_fc1.sharded_state_dict(f"{prefix}linear_fc1.")
        rank, size = self.tp_group.rank, self.tp_group.size
        params = {"weight": self.linear_fc1.weight, "bias": self.linear_fc1.bias}
        for name, local in params.items():
            if local is None:
                continue
            gate, up = local.chunk(2, dim=0)
            for part, data in (("gate", gate), ("up", up)):
                key = f"{prefix}linear_fc1.{part}.{name}"
                pieces[key] = ShardedTensor.from_rank(key, data, 0, rank, size)
        return pieces


def residual_projection(
    config: TransformerConfig, tp_group: RankGroup, input_size: int
) -> RowParallelLinear:
    """The row-parallel projection of a sublayer back into the residual stream (the MLP's
    linear_fc2, attention's linear_proj): input [s, b, input_size/tp], Megatron's scaled
    init (output_layer_init_std), its bias handed to the caller to add with the residual."""
    return RowParallelLinear(
        input_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear,
        input_is_parallel=True, skip_bias_add=True, sequence_parallel=config.sequence_parallel,
        init_method=functools.partial(torch.nn.init.normal_, std=config.output_layer_init_std),
        params_dtype=config.params_dtype,
    )  # fmt: skip


def activate(config: TransformerConfig, inner: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of fc1's output [.., f], or [.., 2f] = [gate; up] when gated.

    Gated (Megatron's glu): with c = activation_func_clamp_value, gate = min(gate, c) and
    up = clamp(up, -c, c); then act(gate) (up + glu_linear_offset), act silu (swiglu),
    GELU (geglu; tanh-approximated with openai_gelu) or quick GELU g sigmoid(1.702 g)
    (quick_geglu). gpt-oss is quick_geglu with c = 7 and
    offset 1: Hugging Face's GptOssExperts, whose (up + 1) is this offset."""
    if config.gated_linear_unit:
        gate, up = inner.chunk(2, dim=-1)
        clamp = config.activation_func_clamp_value
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        if config.quick_geglu:
            act = _quick_gelu(gate)
        elif config.activation == "geglu":  # Gemma's (gelu_pytorch_tanh with openai_gelu)
            act = F.gelu(gate, approximate="tanh" if config.openai_gelu else "none")
        else:
            act = F.silu(gate)
        if config.glu_linear_offset:
            up = up + config.glu_linear_offset
        return act * up
    if config.activation == "squared_relu":
        return F.relu(inner).square()
    return F.gelu(inner, approximate="tanh" if config.openai_gelu else "none")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x sigmoid(1.702 x), the sigmoid approximation of GELU (Hendrycks and Gimpel, 2016)."""
    return x * torch.sigmoid(1.702 * x)
