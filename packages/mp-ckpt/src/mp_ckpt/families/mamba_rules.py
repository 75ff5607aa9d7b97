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
"""

from __future__ import annotations

import torch

from mp_ckpt.families.table import Dims, Rule

__all__ = ["check_time_step_limit", "mamba_rules"]

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
