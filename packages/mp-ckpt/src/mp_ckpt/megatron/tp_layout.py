"""How tensor parallelism cuts a Megatron-LM tensor in the legacy files (megatron-core's
local spec), and how the TP ranks' pieces join again:

    join_pieces(key, pieces, swiglu, whole, parts)    the whole tensor from its pieces
    tp_piece(key, tensor, rank, size, swiglu, parts)   one rank's piece (the inverse)

Column-parallel tensors are cut on rows, row-parallel ones on columns; a gated fc1 is
[gate_r; up_r] per rank; a Mamba mixer's and a gated DeltaNet's in_proj and conv1d hold
each rank's rows of every part (mamba_parts(args)); multi-latent attention's down
projections are whole on every rank under Transformer Engine's spec (latent_rows(args),
whole_rows). read.py, distopt.py, optimizer.py and write.py use it.
"""

from __future__ import annotations

import re

import torch

from mp_ckpt.megatron.linear_attention import gdn_parts

__all__ = ["join_pieces", "latent_rows", "mamba_parts", "tp_piece", "whole_rows"]

# Per-layer tensors split over TP on rows (0) or columns (1); the rest are whole per rank.
_COLUMN = re.compile(
    r"(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj"
    r"|linear_q_down_proj|linear_kv_down_proj|eh_proj)\.(weight|bias)$"
)
# Multi-latent attention's down projections: TP-split by the local spec, whole under TE's.
_DOWN = re.compile(r"\.(linear_q_down_proj|linear_kv_down_proj)\.weight$")
_ROW = re.compile(r"(linear_proj|linear_fc2|mixer\.out_proj|self_attention\.out_proj)\.weight$")
# A Mamba mixer's or a gated DeltaNet's per-head (or per-channel) tensors, split on rows
_MAMBA_ROWS = re.compile(
    r"\.(mixer\.(A_log|D|dt_bias|norm\.weight)|self_attention\.(A_log|dt_bias))$"
)
# A Mamba mixer's or a gated DeltaNet's fused tensors: in_proj and conv1d (each rank:
# [part_r; part_r; ...])
_MAMBA_FUSED = re.compile(r"\.((?:mixer|self_attention)\.(?:in_proj|conv1d))[._](weight|bias)$")


def latent_rows(args) -> dict[str, int]:
    """The rows of multi-latent attention's down projections, by module ({} without it)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    kv = args.kv_lora_rank + args.qk_pos_emb_head_dim
    q = getattr(args, "q_lora_rank", None)
    return {"linear_kv_down_proj": kv} | ({"linear_q_down_proj": q} if q else {})


def mamba_parts(args) -> dict[str, list[int]]:
    """The rows of each part of a Mamba mixer's fused in_proj (z, x, B, C, dt) and conv1d
    (x, B, C), all TP ranks together, under Megatron's defaults; a gated DeltaNet's
    (linear_attention.gdn_parts) in a model with them; {} without either."""
    pattern = _arg_pattern(args)
    if "M" not in pattern:
        return gdn_parts(args)
    head_dim = getattr(args, "mamba_head_dim", None) or 64
    heads = getattr(args, "mamba_num_heads", None) or 2 * args.hidden_size // head_dim
    inner = heads * head_dim
    states = (getattr(args, "mamba_num_groups", None) or 8) * (
        getattr(args, "mamba_state_dim", None) or 128
    )
    return {"mixer.in_proj": [inner, inner, states, states, heads],
            "mixer.conv1d": [inner, states, states]} | gdn_parts(args)  # fmt: skip


def _arg_pattern(args) -> str:
    return (getattr(args, "hybrid_layer_pattern", None)
            or getattr(args, "hybrid_override_pattern", None) or "")  # fmt: skip


def whole_rows(key: str, down_rows: dict[str, int]) -> int | None:
    """The rows of an MLA down projection `key` that TE's spec keeps whole on every rank
    (latent_rows), or None."""
    match = _DOWN.search(key)
    return down_rows.get(match.group(1)) if match else None


def _tp_split(key: str, swiglu: bool) -> int | str | None:
    """How tensor parallelism splits a Megatron tensor (its local spec): on rows (0: the
    column-parallel linear_qkv, linear_fc1 and MLA projections, the embedding and output
    layer, a Mamba mixer's per-head tensors), on columns (1: the row-parallel weights),
    "glu" (a gated fc1: each rank [gate_r; up_r]), "parts" (a Mamba mixer's in_proj or
    conv1d: each rank its rows of every part) or not (None)."""
    if swiglu and re.search(r"linear_fc1\.(weight|bias)$", key):
        return "glu"
    if _MAMBA_FUSED.search(key):
        return "parts"
    if (_COLUMN.search(key) or _MAMBA_ROWS.search(key)
            or key.endswith(("word_embeddings.weight", "output_layer.weight"))):  # fmt: skip
        return 0
    return 1 if _ROW.search(key) else None


def _part_rows(key: str, parts: dict[str, list[int]] | None) -> list[int]:
    """The rows of each part of a Mamba mixer's or gated DeltaNet's fused tensor `key`, all
    ranks together."""
    module = _MAMBA_FUSED.search(key).group(1)
    if module not in (parts or {}):
        raise ValueError(f"{key}: a Mamba mixer's or gated DeltaNet's tensor, but the args "
                         "describe no such layers")  # fmt: skip
    return parts[module]


def join_pieces(
    key: str, pieces: list[torch.Tensor], swiglu: bool, whole: int | None = None, parts=None
) -> torch.Tensor:
    """One tensor from its TP pieces (rank order). whole: the rows of an MLA down
    projection, which TE's spec keeps whole on every rank; parts: mamba_parts(args)."""
    if len(pieces) == 1 or (whole is not None and pieces[0].shape[0] == whole):
        return pieces[0]
    split = _tp_split(key, swiglu)
    if split == "glu":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if split == "parts":
        rows = [n // len(pieces) for n in _part_rows(key, parts)]
        split_pieces = [p.split(rows) for p in pieces]
        return torch.cat([torch.cat([p[j] for p in split_pieces]) for j in range(len(rows))])
    return pieces[0] if split is None else torch.cat(pieces, dim=split)


def tp_piece(key: str, tensor: torch.Tensor, rank: int, size: int, swiglu: bool, parts=None):
    """The TP rank's piece of a whole Megatron tensor (the inverse of join_pieces)."""
    if size == 1:
        return tensor
    split = _tp_split(key, swiglu)
    if split == "glu":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    if split == "parts":
        whole = tensor.split(_part_rows(key, parts))
        return torch.cat([part.chunk(size, 0)[rank] for part in whole])
    return tensor if split is None else tensor.chunk(size, dim=split)[rank]
