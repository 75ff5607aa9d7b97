"""Megatron-LM's args of gated DeltaNet layers and gated attention (Qwen3-Next's), both
ways: `linear_attention_settings(args)` reads them into mp's settings (Megatron's names;
experimental_attention_variant "gated_delta_net", megatron-core 0.19's name, read as
mp's "gdn"), `linear_attention_args(settings)` writes them back ("gated_delta_net", which
megatron-core 0.19 and later read). `gdn_parts(args)` gives the rows of each part of a
DeltaNet's fused in_proj (query, key, value, z, beta, alpha) and conv1d (query, key,
value), all TP ranks together. DeepSeek's sparse attention, the variant "dsa", is
sparse_attention.py's.
"""

from __future__ import annotations

from mp_ckpt.families.table import has_gated_delta_net_layers

__all__ = ["gdn_parts", "linear_attention_args", "linear_attention_settings"]

_WIDTHS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
"""The DeltaNet widths, under Megatron's defaults."""
_VARIANTS = {"gated_delta_net": "gdn", "gdn": "gdn"}


def linear_attention_settings(args, where: str = "args") -> dict:
    """The settings of a model with gated DeltaNet layers or gated attention ({} without)."""
    settings = {}
    if getattr(args, "attention_output_gate", False):
        settings["attention_output_gate"] = True
    variant = getattr(args, "experimental_attention_variant", None)
    if variant in (None, "dsa"):  # a hybrid model's G layers have the widths alone
        return settings | (_widths(args) if _hybrid_gdn(args) else {})
    if variant not in _VARIANTS:
        raise ValueError(f"{where}: experimental_attention_variant={variant!r}: mp imports "
                         "gated_delta_net (gdn) and dsa")  # fmt: skip
    freq = getattr(args, "linear_attention_freq", None)
    if freq is None:
        raise ValueError(f"{where}: experimental_attention_variant={variant!r} without "
                         "linear_attention_freq")  # fmt: skip
    return settings | _widths(args) | {
        "experimental_attention_variant": _VARIANTS[variant],
        "linear_attention_freq": freq if isinstance(freq, int) else [int(x) for x in freq],
    }  # fmt: skip


def _widths(args) -> dict:
    return {name: int(getattr(args, name, None) or default) for name, default in _WIDTHS.items()}


def _hybrid_gdn(args) -> bool:
    """Whether a hybrid model's pattern (args or settings) has gated DeltaNet (G) layers."""
    pattern = (args.get("hybrid_layer_pattern") if isinstance(args, dict)
               else getattr(args, "hybrid_layer_pattern", None))  # fmt: skip
    return "G" in (pattern or "")


def linear_attention_args(settings: dict) -> dict:
    """Megatron's args of the settings' gated DeltaNet layers and gated attention."""
    values = {"attention_output_gate": bool(settings.get("attention_output_gate", False)),
              "experimental_attention_variant": None, "linear_attention_freq": None}  # fmt: skip
    if not has_gated_delta_net_layers(settings):  # (sparse_attention.py writes "dsa")
        if _hybrid_gdn(settings):  # a hybrid model's G layers: the widths alone
            values |= {name: settings.get(name, default) for name, default in _WIDTHS.items()}
        return values
    return values | {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": settings["linear_attention_freq"],
        **{name: settings.get(name, default) for name, default in _WIDTHS.items()},
    }  # fmt: skip


def gdn_parts(args) -> dict[str, list[int]]:
    """The rows of each part of a DeltaNet's in_proj and conv1d ({} without DeltaNets)."""
    variant = getattr(args, "experimental_attention_variant", None)
    if variant not in _VARIANTS and not _hybrid_gdn(args):
        return {}
    widths = _widths(args)
    keys = widths["linear_num_key_heads"] * widths["linear_key_head_dim"]
    values = widths["linear_num_value_heads"] * widths["linear_value_head_dim"]
    heads = widths["linear_num_value_heads"]
    return {"self_attention.in_proj": [keys, keys, values, values, heads, heads],
            "self_attention.conv1d": [keys, keys, values]}  # fmt: skip
