"""The rules of a Mamba-2 mixer, shared by the hybrid families (Nemotron-H, Granite 4).

Hugging Face (its mixer's prefix)                  mp (a hybrid M layer's, decoder.layers.{i}.)
    in_proj.weight [2I + 2GN + H, h]                mixer.in_proj.{z,x,B,C,dt}.weight: rows
                                                    [z (I); x (I); B (G N); C (G N); dt (H)],
                                                    each part viewed by group as mp's
                                                    [G, rows / G, h] (the same memory order)
    conv1d.weight [I + 2GN, 1, 4] and .bias         mixer.conv1d.{x,B,C}.weight [G, rows, 4]
                                                    and .bias [G, rows] (channels [x; B; C])
    dt_bias, A_log, D [H], norm.weight [I],         the same names under mixer.
    out_proj.weight [h, I]
    the layer's norm (its own name)                 norm.weight

H Mamba heads of P channels (I = H P) in G groups, N the state size. `megatron` gives
megatron-core's fused in_proj and conv1d.

Bamba's config.json keys (Bamba, Granite 4: `mamba_settings`, `mamba_config`):
mamba_n_heads, mamba_d_head ("auto": mamba_expand x hidden_size / mamba_n_heads),
mamba_n_groups, mamba_d_state -> mamba_num_heads, mamba_head_dim, mamba_num_groups,
mamba_state_dim; mamba_chunk_size kept to be written back (mp's scan is exact whatever
the chunk); mamba_d_conv other than 4, mamba_conv_bias false, mamba_proj_bias true and a
time_step_limit other than (0, inf) refused.
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import refuse
from mp_ckpt.families.moe_settings import positive
from mp_ckpt.families.table import Dims, Rule

__all__ = ["check_time_step_limit", "mamba_config", "mamba_rules", "mamba_settings"]

_IN_PROJ = ("z", "x", "B", "C", "dt")
_CONV = ("x", "B", "C")


def _rows(dims: Dims, parts: tuple[str, ...]) -> list[int]:
    """The rows (in_proj) or channels (conv1d) of each part, all groups together."""
    inner, gn = dims.mamba_heads * dims.mamba_head_dim, dims.mamba_groups * dims.mamba_state
    return [{"z": inner, "x": inner, "B": gn, "C": gn, "dt": dims.mamba_heads}[p] for p in parts]


def _grouped(parts: tuple[str, ...]):
    """HF's fused [rows, ...] (conv1d's weight [rows, 1, K]) -> mp's parts [G, rows / G, ...]."""

    def to_mp(t, dims: Dims) -> list[torch.Tensor]:
        fused = t[0].reshape(t[0].shape[0], -1) if t[0].dim() == 3 else t[0]
        return [part.reshape(dims.mamba_groups, -1, *part.shape[1:])
                for part in fused.split(_rows(dims, parts))]  # fmt: skip

    return to_mp


def _fused(conv: bool = False):
    """mp's parts [G, rows / G, ...] -> HF's fused tensor (conv1d's weight [rows, 1, K])."""

    def to_hf(t, dims: Dims) -> list[torch.Tensor]:
        fused = torch.cat([part.reshape(-1, *part.shape[2:]) for part in t])
        return [fused[:, None, :] if conv and fused.dim() == 2 else fused]

    return to_hf


def mamba_rules(mixer: str, norm: str) -> tuple[Rule, ...]:
    """The "mamba" rules of a mixer whose tensors are under `mixer` (a Hugging Face prefix
    with "{i}") and of the layer's norm, Hugging Face's `norm`."""
    return (
        Rule(("norm.weight",), norm, "mamba"),
        Rule(tuple(f"mixer.in_proj.{p}.weight" for p in _IN_PROJ), mixer + "in_proj.weight",
             "mamba", to_mp=_grouped(_IN_PROJ), to_hf=_fused(), megatron="mixer.in_proj"),
        Rule(tuple(f"mixer.conv1d.{p}.weight" for p in _CONV), mixer + "conv1d.weight",
             "mamba", to_mp=_grouped(_CONV), to_hf=_fused(conv=True), megatron="mixer.conv1d"),
        Rule(tuple(f"mixer.conv1d.{p}.bias" for p in _CONV), mixer + "conv1d.bias", "mamba",
             to_mp=_grouped(_CONV), to_hf=_fused(), megatron="mixer.conv1d"),
        *(Rule((f"mixer.{n}",), mixer + n, "mamba")
          for n in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")),
    )  # fmt: skip


def _value(number) -> float:
    """A float of config.json, also as transformers 5 writes infinity ({"__float__": ...})."""
    return float(number["__float__"]) if isinstance(number, dict) else float(number)


def check_time_step_limit(config: dict) -> None:
    """Refuses a time_step_limit other than (0, inf): mp's mixer, as Megatron's, does not
    clamp the time step."""
    limit = config.get("time_step_limit", (0.0, float("inf")))
    if limit is not None and [_value(v) for v in limit] != [0.0, float("inf")]:
        raise ValueError(f"config.json time_step_limit={limit!r}: mp's Mamba mixer does not "
                         "clamp the time step (time_step_limit (0, inf))")  # fmt: skip


_DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
             "mamba_chunk_size": 256, "mamba_expand": 2}  # fmt: skip
"""transformers' BambaConfig and GraniteMoeHybridConfig defaults, for a key config.json
omits."""


def mamba_settings(config: dict) -> dict:
    """The Mamba mixers' settings of Bamba's config.json keys (module docstring)."""
    for key, supported in (("mamba_d_conv", 4), ("mamba_conv_bias", True),
                           ("mamba_proj_bias", False)):  # fmt: skip
        refuse(config, key, supported)
    check_time_step_limit(config)
    heads = positive(config, "mamba_n_heads", _DEFAULTS)
    head_dim = config.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = positive(config, "mamba_expand", _DEFAULTS) * config["hidden_size"] // heads
    return {
        "mamba_num_heads": heads, "mamba_head_dim": positive({"mamba_d_head": head_dim},
                                                             "mamba_d_head", {}),
        "mamba_num_groups": positive(config, "mamba_n_groups", _DEFAULTS),
        "mamba_state_dim": positive(config, "mamba_d_state", _DEFAULTS),
        "mamba_chunk_size": positive(config, "mamba_chunk_size", _DEFAULTS),
    }  # fmt: skip


def mamba_config(settings: dict, hidden: int) -> dict:
    """Bamba's config.json keys of the Mamba mixers' settings."""
    dims = Dims.of(settings | {"hybrid_layer_pattern": "M"})  # the widths, Mamba layers or not
    inner = dims.mamba_heads * dims.mamba_head_dim
    if inner % hidden:
        raise ValueError(f"the Mamba mixers' width {inner} is not a multiple of hidden_size="
                         f"{hidden} (config.json's mamba_expand)")  # fmt: skip
    return {
        "mamba_n_heads": dims.mamba_heads, "mamba_d_head": dims.mamba_head_dim,
        "mamba_n_groups": dims.mamba_groups, "mamba_d_state": dims.mamba_state,
        "mamba_chunk_size": settings.get("mamba_chunk_size") or _DEFAULTS["mamba_chunk_size"],
        "mamba_expand": inner // hidden, "mamba_d_conv": 4, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "time_step_limit": [0.0, float("inf")],
    }  # fmt: skip
