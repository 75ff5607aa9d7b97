"""FP8 GEMMs for the transformer layers' tensor-parallel linear layers, through torchao.

Shapes: x [s, b, in] (or this rank's [s, b, in/tp]); weight [out/tp, in] or [out, in/tp],
this rank's piece; the GEMM gives [s, b, out/tp] or the partial sum [s, b, out].

torchao's float8 training casts each GEMM operand to FP8 with a scale computed from its
current absolute maximum (per tensor, or per row with the rowwise recipe) and runs
torch._scaled_mm; the backward casts the output gradient the same way (e5m2 with the hybrid
format). mp applies it to the local GEMM of each ColumnParallelLinear and RowParallelLinear
inside the transformer layers, so tensor parallelism is unchanged around it: every rank
scales its own piece of the weight, a replicated input has the same scale on every rank,
and a row-parallel layer's partial sums are reduced in bf16 after the GEMM. Under sequence
parallelism the column-parallel input is gathered before the GEMM and the gathered input
is what the GEMM keeps for its backward (bf16, [s, b, in]): unlike the bf16 path, which
gathers it again in the backward. The embedding, the output layer, norms, attention and
the routed experts stay in bf16 (torchtitan and Megatron keep the output layer in bf16
too). Parameters stay in their dtype: checkpoints do not change.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from mp_layers.config import TransformerConfig
from mp_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["Fp8Matmul", "apply_fp8", "check_fp8_device", "fp8_layer_numbers"]

_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards."""

_GEMM_MULTIPLE = 16
"""torch._scaled_mm needs both dimensions of each operand divisible by 16."""


def _torchao_float8():
    # torchao registers an enum with torch's pytree at import, which newer torch releases
    # answer with a deprecation warning on every run: quiet for the import only.
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as error:
        raise RuntimeError(
            f"--fp8-format needs torchao's float8 training (pip install 'mp-layers[fp8]'): {error}"
        ) from None
    finally:
        pytree_log.setLevel(level)
    return float8, Float8Linear


def check_fp8_device(config: TransformerConfig, device: torch.device) -> None:
    """Raises a RuntimeError in one line when `config` asks for FP8 that `device` cannot run."""
    if config.fp8 is None:
        return
    _torchao_float8()
    if config.fp8_emulate:
        return
    if device.type != "cuda":
        raise RuntimeError(
            f"--fp8-format {config.fp8} needs a CUDA GPU with FP8 tensor cores (compute "
            f"capability 8.9+: L4, L40S, H100, H200, B200); this rank computes on {device} "
            "(--fp8-emulate checks FP8 numerics without one, slowly)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"--fp8-format {config.fp8} needs FP8 tensor cores (compute capability 8.9+); "
            f"{name} has {capability[0]}.{capability[1]}"
        )


def fp8_layer_numbers(config: TransformerConfig) -> range:
    """The model's layer indices whose linear layers compute in FP8."""
    if config.fp8 is None:
        return range(0)
    if not config.first_last_layers_bf16:
        return range(config.num_layers)
    return range(
        config.num_layers_at_start_in_bf16,
        config.num_layers - config.num_layers_at_end_in_bf16,
    )


class Fp8Matmul:
    """x @ weight.t() with torchao's FP8 casts and GEMMs; the weight is the layer's own
    parameter, passed at each call (torchao's module is built on the meta device and holds
    none, so the layer's parameters and state dict are unchanged)."""

    def __init__(self, config: TransformerConfig, in_features: int, out_features: int) -> None:
        float8, float8_linear = _torchao_float8()
        self._module = _float8_linear(float8, float8_linear, config, in_features, out_features)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self._module, {"weight": weight}, (x,))


def _float8_linear(float8, float8_linear, config, in_features: int, out_features: int):
    recipe = float8.Float8LinearConfig.from_recipe_name(config.fp8_recipe)
    # torchao's tensorwise recipe casts the output gradient to e5m2 (Megatron's hybrid):
    # the format decides it here, for both backward GEMMs.
    grad_dtype = torch.float8_e5m2 if config.fp8 == "hybrid" else torch.float8_e4m3fn
    changes: dict = {"emulate": config.fp8_emulate}
    for name in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"):
        changes[name] = dataclasses.replace(getattr(recipe, name), target_dtype=grad_dtype)
    if not config.fp8_wgrad:
        # The weight gradient's GEMM takes the input and the output gradient unscaled.
        disabled = float8.CastConfig(scaling_type=float8.ScalingType.DISABLED)
        changes["cast_config_input_for_grad_weight"] = disabled
        changes["cast_config_grad_output_for_grad_weight"] = disabled
    recipe = dataclasses.replace(recipe, **changes)
    with torch.device("meta"):
        return float8_linear(in_features, out_features, bias=False, config=recipe)


def apply_fp8(layers: torch.nn.ModuleList, config: TransformerConfig, layer_offset: int) -> int:
    """Makes the tensor-parallel linear layers of `layers` (this stage's, the first being
    the model's layer `layer_offset`) compute in FP8, except the layers kept in bf16 and the
    routed experts (grouped GEMMs, not these layers). Returns how many linear layers now
    compute in FP8."""
    chosen = fp8_layer_numbers(config)
    count = 0
    for index, layer in enumerate(layers):
        if layer_offset + index not in chosen:
            continue
        for name, module in layer.named_modules():
            if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                continue
            out_features, in_features = module.weight.shape
            for dim, size in (("output", out_features), ("input", in_features)):
                if size % _GEMM_MULTIPLE:
                    raise ValueError(
                        f"--fp8-format: layer {layer_offset + index} {name} has {size} "
                        f"{dim} features on this rank, not a multiple of {_GEMM_MULTIPLE} "
                        "(FP8 GEMMs need it)"
                    )
            module.fp8_matmul = Fp8Matmul(config, in_features, out_features)
            count += 1
    return count
