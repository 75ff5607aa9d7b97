"""TransformerConfig's FP8 fields (Fp8Config, a base of it; Megatron's --fp8-* options,
computed with torchao's float8 training) and the rules that hold whatever the device
(`check_fp8`, from __post_init__). Whether this rank's device can run FP8 is
`mp_layers.fp8.check_fp8_device`. Every message names the field and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mp_layers.config_rules import choice, left_default

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["Fp8Config", "check_fp8"]


@dataclass(kw_only=True)
class Fp8Config:
    """FP8 (Megatron's --fp8-* options), through torchao's float8 training: a base of
    TransformerConfig, checked by `check_fp8`."""

    fp8: Literal["e4m3", "hybrid"] | None = field(
        default=None, metadata={"argparse_meta": {"names": ["--fp8-format"]}}
    )
    """FP8 GEMMs in the transformer layers' linear layers (Megatron's --fp8-format), through
    torchao's float8 training (pip install 'mp-layers[fp8]'): e4m3 for every FP8 tensor, or
    hybrid: e4m3 for activations and weights, e5m2 for the output gradients. Needs bf16 and a
    CUDA GPU with FP8 tensor cores (compute capability 8.9+); the embedding, the output layer,
    norms, attention and routed experts stay in bf16, and parameters, gradients and
    checkpoints keep their dtypes. None: no FP8."""

    fp8_recipe: Literal["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom"] = (
        "tensorwise"
    )
    """How FP8 tensors are scaled, from their current absolute maximum: one scale per tensor,
    or one per row (torchao's rowwise recipe, e4m3 only). Megatron's default, delayed scaling
    from an amax history, is Transformer Engine's and is refused, as are mxfp8, blockwise
    and custom."""

    fp8_wgrad: bool = True
    """Compute the weight gradients' GEMMs in FP8 too; --no-fp8-wgrad keeps them in bf16."""

    fp8_emulate: bool = False
    """Emulate the FP8 casts and GEMMs (torchao's emulate: FP8 rounding, matmuls in high
    precision) on any device, a CPU included: slow, for checking FP8 numerics and layouts on a
    machine without an FP8 GPU."""

    first_last_layers_bf16: bool = False
    """Keep the first num_layers_at_start_in_bf16 and the last num_layers_at_end_in_bf16
    transformer layers of the model in bf16 under --fp8-format. Each count is at most a
    pipeline stage's layers, and the two may overlap (Megatron-LM's bounds)."""

    num_layers_at_start_in_bf16: int = 1
    """Layers at the start of the model kept in bf16 with first_last_layers_bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Layers at the end of the model kept in bf16 with first_last_layers_bf16."""


_REFUSED_RECIPES = {
    "delayed": "delayed scaling (an amax history) is Transformer Engine's and torchao's "
    "float8 training has none",
    "mxfp8": "MXFP8 needs Transformer Engine on a Blackwell GPU",
    "blockwise": "blockwise scaling needs Transformer Engine",
    "custom": "a custom quantizer factory needs Transformer Engine",
}

_FP8_ONLY = {
    "fp8_recipe": "tensorwise",
    "fp8_wgrad": True,
    "fp8_emulate": False,
    "first_last_layers_bf16": False,
}
"""Fields that mean something only with fp8 set: changed without it, refused."""


def check_fp8(config: TransformerConfig) -> None:
    if config.fp8 is None:
        left_default(config, _FP8_ONLY, "fp8 (--fp8-format)")
        return
    choice("fp8", config.fp8, ("e4m3", "hybrid"))
    if config.fp8_recipe in _REFUSED_RECIPES:
        raise ValueError(
            f"fp8_recipe={config.fp8_recipe!r}: {_REFUSED_RECIPES[config.fp8_recipe]}; "
            "use --fp8-recipe tensorwise (mp's default) or rowwise"
        )
    choice("fp8_recipe", config.fp8_recipe, ("tensorwise", "rowwise"))
    if config.fp8_recipe == "rowwise" and config.fp8 == "hybrid":
        raise ValueError(
            "fp8='hybrid' with fp8_recipe='rowwise': torchao's rowwise recipe scales e4m3 "
            "tensors only; use --fp8-format e4m3, or --fp8-recipe tensorwise"
        )
    if not config.bf16:
        raise ValueError(
            f"fp8={config.fp8!r} needs bf16=True: the FP8 GEMMs take and give bf16 activations"
        )
    if config.first_last_layers_bf16:
        # Megatron-LM's bounds: each at most a pipeline stage's layers (mp-train checks the
        # stage's; the model's here); the two may overlap, every layer then in bf16.
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
            if value > config.num_layers:
                raise ValueError(f"{name}={value} exceeds num_layers={config.num_layers}")
