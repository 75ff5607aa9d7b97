"""TransformerConfig's recompute fields: recompute_granularity, recompute_method and
recompute_num_layers (check_recompute), Megatron-LM's reading of the deprecated
moe_layer_recompute (apply_moe_layer_recompute), and recompute_modules (Megatron's
--recompute-modules under --recompute-granularity selective) with the rules Megatron-LM
sets on its names.

Two kinds of recompute stand behind the names:

- torch's activation checkpointing (transformer/recompute.py), which keeps a module's
  inputs and runs it again in backward: "core_attn", "mlp", "moe", "shared_experts";
- output-discarding recompute (transformer/output_recompute.py): a cheap function's output
  is freed after the next module saved it and rebuilt when backward reaches that module:
  "layernorm" (a layer's input and pre-MLP norms), "moe_act" (the experts' activation
  and routing weight), "mla_up_proj" (multi-latent attention's up projections and
  rotary embeddings).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from mp_layers.config_linear_attention import has_gated_delta_nets
from mp_layers.config_rules import choice

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "RECOMPUTE_MODULES",
    "apply_moe_layer_recompute",
    "check_recompute",
    "check_recompute_modules",
]

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "moe_act",
                     "mla_up_proj", "gdn_norm_out")  # fmt: skip
"""The names of recompute_modules mp honours (TransformerConfig.recompute_modules)."""
_REFUSED_RECOMPUTE = {
    "gdp_in_proj": "gated DeltaProduct layers",
    "gdp_qkv": "gated DeltaProduct layers",
    "mhc": "hyper-connections",
}
"""Megatron's other recompute_modules, refused naming what they would recompute."""


def apply_moe_layer_recompute(config: TransformerConfig) -> None:
    """Megatron-LM's reading of moe_layer_recompute (its TransformerConfig): selective
    recompute with "moe" added to recompute_modules; refused under full recompute."""
    if not config.moe_layer_recompute:
        return
    if config.recompute_granularity == "full":
        raise ValueError("moe_layer_recompute=True with recompute_granularity='full': full "
                         "recompute takes whole layers already (Megatron-LM refuses the "
                         "pair)")  # fmt: skip
    config.recompute_granularity = "selective"
    modules = ["core_attn"] if config.recompute_modules is None else config.recompute_modules
    if "moe" not in modules:
        config.recompute_modules = [*modules, "moe"]


def check_recompute(config: TransformerConfig) -> None:
    """recompute_granularity, recompute_method and recompute_num_layers, as Megatron-LM
    checks them."""
    granularity = config.recompute_granularity
    method, n = config.recompute_method, config.recompute_num_layers
    if granularity is not None:
        choice("recompute_granularity", granularity, ("full", "selective"))
    if method is not None:
        choice("recompute_method", method, ("uniform", "block"))
    if granularity == "full":
        if method is None or n is None:
            raise ValueError(
                "recompute_granularity='full' needs recompute_method ('uniform' or 'block') "
                f"and recompute_num_layers, got {method!r} and {n!r}"
            )
        # Above a stage's layers it takes them all, as in Megatron-LM: "uniform" one group
        # of the stage, "block" every layer of it.
        if n < 1:
            raise ValueError(f"recompute_num_layers={n} must be >= 1")
    elif granularity is None and (method is not None or n is not None):
        # Megatron-LM's own test lines give them without a granularity: it reads them not
        warnings.warn(
            f"recompute_method={method!r} and recompute_num_layers={n!r} without "
            "recompute_granularity: nothing is recomputed, so they change nothing "
            "(Megatron-LM accepts them there too)",
            stacklevel=2,
        )
    elif method is not None or n is not None:
        raise ValueError(
            f"recompute_method={method!r} and recompute_num_layers={n!r} apply only to "
            f"recompute_granularity='full', got {granularity!r}"
        )


def check_recompute_modules(config: TransformerConfig) -> None:
    """recompute_modules' names, with Megatron's rules: gdn_norm_out needs gated DeltaNets,
    moe_act grouped experts (moe_grouped_gemm), mla_up_proj multi-latent attention."""
    modules = config.recompute_modules
    if modules is None:
        return
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"recompute_modules={modules!r} must be a list of module names")
    for module in modules:
        if module in _REFUSED_RECOMPUTE:
            raise ValueError(
                f"recompute_modules: {module!r} ({_REFUSED_RECOMPUTE[module]}) is not "
                f"implemented; mp recomputes {', '.join(RECOMPUTE_MODULES)}"
            )
        if module not in RECOMPUTE_MODULES:
            raise ValueError(f"recompute_modules: {module!r} is not one of "
                             f"{', '.join(RECOMPUTE_MODULES)}")  # fmt: skip
    if config.recompute_granularity != "selective":
        return  # as in Megatron, the names are not checked further without selective
    rules = {
        "gdn_norm_out": (has_gated_delta_nets(config), "gated DeltaNet layers"),
        "moe_act": (config.moe_grouped_gemm, "moe_grouped_gemm (--moe-grouped-gemm)"),
        "mla_up_proj": (config.multi_latent_attention,
                        "multi_latent_attention (--multi-latent-attention)"),
    }  # fmt: skip
    for module, (holds, what) in rules.items():
        if module in modules and not holds:
            raise ValueError(f"recompute_modules: {module!r} needs {what} (Megatron's rule)")
