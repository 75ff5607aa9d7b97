"""TransformerConfig's Mamba-hybrid fields (HybridConfig, a base of it; Megatron's
--hybrid-layer-pattern and --mamba-* options) and their checks: the pattern's symbols and
length, the Mamba mixers' widths, and what hybrid models do not take. `hybrid_layer_kinds`
gives each layer's kind.

A hybrid model (Megatron's HybridModel / MambaModel: Nemotron-H, Nemotron-Nano-9B-v2,
Nemotron 3) has one sublayer per layer, as its pattern says, each with its own pre-norm:

    M   a Mamba-2 mixer (transformer/mamba_mixer.py)
    G   a gated DeltaNet (transformer/gated_delta_net.py; its widths the linear_* fields)
    *   self-attention
    -   a dense MLP
    E   a mixture-of-experts MLP

Multi-token prediction (Megatron's unified pattern): "<main>/<mtp>/<mtp>..." gives the
decoder's layers, then the layers of each multi-token prediction module, one part per
module, all alike ("M*M*/*E": four decoder layers, one module of attention then MoE);
mtp_num_layers is the number of parts (`infer_hybrid_mtp`).

Pipeline segments (Megatron's "|" in the decoder's part): "M*M|*M*|M*" gives each virtual
pipeline stage its layers, in virtual-stage order (`hybrid_pipeline_segments`); the run
takes virtual_pipeline_model_parallel_size from their number."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "HYBRID_SYMBOLS",
    "HybridConfig",
    "check_hybrid",
    "check_hybrid_parallel",
    "hybrid_layer_kinds",
    "hybrid_pipeline_segments",
    "infer_hybrid_mtp",
    "mamba_widths",
    "split_hybrid_pattern",
]


@dataclass(kw_only=True)
class HybridConfig:
    """Mamba-hybrid models (Megatron's --hybrid-layer-pattern and --mamba-* options): a
    base of TransformerConfig, checked by `check_hybrid`."""

    hybrid_layer_pattern: str | None = None
    """A hybrid model's layers, one symbol each (Megatron's --hybrid-layer-pattern; Nemotron-H,
    Nemotron-Nano-9B-v2, Nemotron 3): M a Mamba-2 mixer, * self-attention, - a dense MLP,
    E a mixture-of-experts MLP, each layer one of them behind its own norm
    ("M-M-M*-..."); as many symbols as num_layers. Megatron's unified form
    "<main>/<mtp>/<mtp>..." adds multi-token prediction modules, each of the layers after a
    "/" (mtp_num_layers is their number), and "|" in the main part splits the layers into
    pipeline segments, one per virtual pipeline stage. None: every layer is attention then
    an MLP."""

    mamba_num_heads: int | None = None
    """Heads of each Mamba mixer; None: Megatron's default, an inner width of 2 x
    hidden_size divided into heads of mamba_head_dim."""

    mamba_head_dim: int = 64
    """Channels of each Mamba head (Megatron's default 64)."""

    mamba_num_groups: int = 8
    """Groups of Mamba heads sharing their B and C projections (Megatron's default 8); the
    tensor-parallel size must divide it."""

    mamba_state_dim: int = 128
    """The state size n of each Mamba head's channels (Megatron's default 128)."""


HYBRID_SYMBOLS = {"M": "mamba", "G": "gdn", "*": "attention", "-": "mlp", "E": "moe"}
"""The layer kinds of a hybrid pattern, by Megatron's symbol."""

_OTHER_SYMBOLS = {
    "D": "DeepSeek sparse attention layers",
    "+": "multi-latent attention layers",
}
"""Megatron's other symbols, which mp refuses naming what they stand for."""


def split_hybrid_pattern(pattern: str) -> tuple[str, str | None, int]:
    """(the decoder's layers, one multi-token prediction module's or None, the number of
    modules) of a unified pattern "<main>/<mtp>/<mtp>..."; the decoder's without its
    pipeline segments' "|"; parts after "/" that are all empty give no modules
    (Megatron's reading)."""
    main, *modules = pattern.split("/")
    main = main.replace("|", "")
    if not any(modules):
        return main, None, 0
    for k, part in enumerate(modules[1:], start=2):
        if part != modules[0]:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r}: every multi-token prediction module's "
                f"pattern must be alike; the first is {modules[0]!r}, module {k}'s {part!r}"
            )
    return main, modules[0], len(modules)


def hybrid_pipeline_segments(config: TransformerConfig) -> list[int] | None:
    """The decoder layers of each "|"-separated segment of the pattern (one per virtual
    pipeline stage, in their order); None without "|"."""
    pattern = config.hybrid_layer_pattern
    if pattern is None or "|" not in pattern.split("/")[0]:
        return None
    return [len(segment) for segment in pattern.split("/")[0].split("|")]


def hybrid_layer_kinds(config: TransformerConfig) -> list[str]:
    """Per decoder layer of the whole model: "mamba", "gdn", "attention", "mlp" or "moe" for
    a hybrid model, "transformer" (attention then an MLP) for every layer otherwise."""
    pattern = config.hybrid_layer_pattern
    if pattern is None:
        return ["transformer"] * config.num_layers
    return [HYBRID_SYMBOLS[symbol] for symbol in split_hybrid_pattern(pattern)[0]]


def infer_hybrid_mtp(config: TransformerConfig) -> None:
    """mtp_num_layers from the pattern's multi-token prediction parts, as Megatron-LM infers
    it: set when None, and when given otherwise replaced with a warning."""
    pattern = config.hybrid_layer_pattern
    if not isinstance(pattern, str) or "/" not in pattern:
        return
    _, module, depths = split_hybrid_pattern(pattern)
    if module is None:
        return
    if config.mtp_num_layers is not None and config.mtp_num_layers != depths:
        warnings.warn(
            f"mtp_num_layers={config.mtp_num_layers} conflicts with the {depths} multi-token "
            f"prediction modules of hybrid_layer_pattern={pattern!r}: using {depths}",
            stacklevel=4,  # the caller of TransformerConfig(...)
        )
    config.mtp_num_layers = depths


def mamba_widths(config: TransformerConfig) -> tuple[int, int]:
    """(heads, inner width) of the Mamba mixers: mamba_num_heads x mamba_head_dim, or
    Megatron's default without mamba_num_heads, an inner width of 2 x hidden_size."""
    if config.mamba_num_heads is not None:
        return config.mamba_num_heads, config.mamba_num_heads * config.mamba_head_dim
    inner = 2 * config.hidden_size
    return inner // config.mamba_head_dim, inner


def check_hybrid(config: TransformerConfig) -> None:
    """The rules of the hybrid fields that hold whatever the parallel layout."""
    pattern = config.hybrid_layer_pattern
    if pattern is None:
        return
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid_layer_pattern={pattern!r} must be a string of layer symbols")
    main, module, _ = split_hybrid_pattern(pattern)
    if "|" in pattern.partition("/")[2]:
        raise ValueError(f"hybrid_layer_pattern={pattern!r}: '|' separates the decoder's "
                         "pipeline segments, not multi-token prediction layers")  # fmt: skip
    segments = hybrid_pipeline_segments(config)
    if segments is not None and min(segments) == 0:
        raise ValueError(f"hybrid_layer_pattern={pattern!r}: pipeline segment "
                         f"{segments.index(0)} holds no layers (mp's pipeline stages hold one "
                         "at least)")  # fmt: skip
    for symbol in main + (module or ""):
        if symbol in _OTHER_SYMBOLS:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r}: {symbol!r} ({_OTHER_SYMBOLS[symbol]}) is "
                "not implemented; mp builds M (Mamba), G (gated DeltaNet), * (attention), - "
                "(MLP) and E (MoE)"
            )
        if symbol not in HYBRID_SYMBOLS:
            raise ValueError(
                f"hybrid_layer_pattern={pattern!r}: {symbol!r} is not a layer symbol "
                "(M, G, *, -, E)"
            )
    if len(main) != config.num_layers:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r} has {len(main)} decoder layers, num_layers="
            f"{config.num_layers}: one symbol per layer"
        )
    if config.mtp_num_layers and module is None:
        raise ValueError(
            f"mtp_num_layers={config.mtp_num_layers} in a hybrid model needs the layers of its "
            f"modules in hybrid_layer_pattern={pattern!r}: '<main>/<mtp>', one '/<mtp>' per "
            "module (e.g. 'M*M*/*E' for one module of attention then MoE)"
        )
    if "E" in pattern and config.num_moe_experts is None:
        raise ValueError(
            f"hybrid_layer_pattern={pattern!r} has E layers: they need num_moe_experts"
        )
    if config.num_moe_experts is not None and "E" not in pattern:
        raise ValueError(
            f"num_moe_experts={config.num_moe_experts} in a hybrid model needs E layers in "
            f"hybrid_layer_pattern={pattern!r}"
        )
    if list(config.moe_layer_freq) != [1]:
        raise ValueError(
            f"moe_layer_freq={config.moe_layer_freq!r} with hybrid_layer_pattern: the "
            "pattern's E layers are the MoE layers"
        )
    refused = {"multi_latent_attention": config.multi_latent_attention, "fp8": config.fp8}
    for name, value in refused.items():
        if value:
            raise ValueError(f"{name}={value!r} with hybrid_layer_pattern is not implemented")
    for name in ("mamba_head_dim", "mamba_num_groups", "mamba_state_dim"):
        positive(name, getattr(config, name))
    if config.mamba_num_heads is not None:
        positive("mamba_num_heads", config.mamba_num_heads)
    heads, inner = mamba_widths(config)
    if heads * config.mamba_head_dim != inner:
        raise ValueError(
            f"mamba_head_dim={config.mamba_head_dim} does not divide the Mamba inner width "
            f"{inner} (2 x hidden_size without mamba_num_heads)"
        )
    if heads % config.mamba_num_groups:
        raise ValueError(
            f"mamba_num_groups={config.mamba_num_groups} does not divide the {heads} Mamba heads"
        )


def check_hybrid_parallel(config: TransformerConfig, tp: int, cp: int) -> None:
    """Tensor parallelism splits the Mamba mixers by whole groups of heads, and context
    parallelism splits each tensor-parallel rank's heads again, by whole groups or a
    group's heads (transformer/mamba_context_parallel.py)."""
    if config.hybrid_layer_pattern is None or "M" not in config.hybrid_layer_pattern:
        return
    if config.mamba_num_groups % tp:
        raise ValueError(
            f"mamba_num_groups={config.mamba_num_groups} is not divisible by "
            f"tensor_model_parallel_size={tp}: each rank holds whole groups of Mamba heads"
        )
    if cp > 1:
        from mp_layers.transformer.mamba_context_parallel import check_split

        heads, _ = mamba_widths(config)
        try:
            check_split(config.mamba_num_groups // tp, heads // tp, cp)
        except ValueError as error:
            raise ValueError(
                f"mamba_num_groups={config.mamba_num_groups}, {heads} Mamba heads at "
                f"tensor_model_parallel_size={tp}: {error}"
            ) from None
