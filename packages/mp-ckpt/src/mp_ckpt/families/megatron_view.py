"""The family tables seen from Megatron-LM: each Megatron tensor, the mp tensors it holds
and how they are fused there.

    megatron_view(settings, family=None) -> MegatronView
        .named(name, layer)      the MegatronTensor Megatron stores as `name` (or under
                                 its Transformer Engine alias), or None
        .holding(mp_name, layer) (the MegatronTensor holding mp's tensor, its index), or None
        .tensors                 every one

A Megatron checkpoint records no family: the view is the table of the family the
settings describe (`family_of`), completed by gpt_model.py's table of every tensor mp's
GPTModel can have for the tensors the family does not name. A family rule for a tensor
the settings' model cannot have (gate and up where the MLP is not gated) is left out.
Names are relative to "decoder.layers.{i}." except in the "model" scope, as in the tables.

How mp's tensors are fused ([groups, heads per group, d, ...] q, [groups, d, ...] k and
v; E the experts, F an MLP's width, h the hidden size):

    "qkv"  linear_qkv [groups x (heads per group + 2) x d, ...]: per query group its
           query heads, then its key, then its value (Megatron's interleaving)
    "glu"  a gated fc1 [gate; up]: [2F, h] on dim 0, the experts' [E, 2F, h] on dim 1
    None   one mp tensor, as it is (perhaps renamed)

Transformer Engine's layer specs fuse a layer's norms into the next linear layer:
input_layernorm is saved as self_attention.linear_qkv.layer_norm_*, pre_mlp_layernorm
as mlp.linear_fc1.layer_norm_* (`te`; torch_dist checkpoints use these names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mp_ckpt import families
from mp_ckpt.families import gpt_model
from mp_ckpt.families.table import Dims, Family, Rule, Scope

__all__ = ["MegatronTensor", "MegatronView", "megatron_name", "megatron_view"]

Fusion = Literal["qkv", "glu"]
_FUSIONS: dict[tuple[str, ...], Fusion] = {("q", "k", "v"): "qkv", ("gate", "up"): "glu"}
# mp keeps the experts stacked on dim 0: their [gate; up] is on dim 1
_STACKED = "mlp.experts."
_TE_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_"}  # fmt: skip


def megatron_name(rule: Rule, mp_name: str) -> str:
    """Megatron's name of one of the rule's mp tensors."""
    if rule.megatron is None:
        return mp_name
    return f"{rule.megatron}.{mp_name.rsplit('.', 1)[1]}"


@dataclass(frozen=True)
class MegatronTensor:
    name: str
    mp: tuple[str, ...]
    """mp's tensors it holds, in the order the fusion stacks them."""
    scope: Scope
    fusion: Fusion | None = None
    dim: int = 0
    """The dim a "glu" fusion stacks gate and up on."""
    te: str | None = None
    """Transformer Engine's name for it (a norm fused into the next linear layer)."""

    def mp_shapes(self, shape: Sequence[int], dims: Dims) -> list[tuple[int, ...]]:
        """The shapes of mp's tensors cut from a Megatron tensor of `shape`."""
        shape = tuple(shape)
        if self.fusion is None:
            return [shape]
        if self.fusion == "glu":
            first, second = list(shape), list(shape)
            first[self.dim] -= shape[self.dim] // 2  # torch.chunk's first half
            second[self.dim] = shape[self.dim] // 2
            return [tuple(first), tuple(second)]
        groups, per_group, d, tail = dims.groups, dims.per_group, dims.head_dim, shape[1:]
        expected = groups * (per_group + 2) * d
        if shape[0] != expected:
            raise ValueError(
                f"has {shape[0]} rows; {groups} query groups of {per_group} heads (+ k, v) "
                f"of {d} channels make {expected}"
            )
        return [(groups, per_group, d, *tail), (groups, d, *tail), (groups, d, *tail)]

    def cut(self, tensor: torch.Tensor, j: int, dims: Dims) -> torch.Tensor:
        """mp's j-th tensor (a view) of the Megatron tensor."""
        if self.fusion is None:
            return tensor
        if self.fusion == "glu":
            return tensor.chunk(2, dim=self.dim)[j]
        fused = tensor.reshape(dims.groups, dims.per_group + 2, dims.head_dim, *tensor.shape[1:])
        return fused[:, : dims.per_group] if j == 0 else fused[:, dims.per_group + j - 1]

    def fuse(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The Megatron tensor from mp's (in `mp` order); the inverse of `cut`."""
        if self.fusion is None:
            (tensor,) = tensors
            return tensor
        if self.fusion == "glu":
            return torch.cat(list(tensors), dim=self.dim).contiguous()
        q, k, v = tensors
        whole = torch.cat([q, k.unsqueeze(1), v.unsqueeze(1)], dim=1)
        return whole.reshape(-1, *q.shape[3:]).contiguous()


class MegatronView:
    """Megatron's tensors of a model, looked up by their name or by an mp tensor's."""

    def __init__(self, tensors: Sequence[MegatronTensor]) -> None:
        self.tensors = tuple(tensors)
        self._named: dict[tuple[bool, str], MegatronTensor] = {}
        self._holding: dict[tuple[bool, str], tuple[MegatronTensor, int]] = {}
        for tensor in self.tensors:
            layer = tensor.scope != "model"
            for name in (tensor.name, tensor.te):
                if name is not None:
                    self._named[(layer, name)] = tensor
            for j, mp_name in enumerate(tensor.mp):
                self._holding[(layer, mp_name)] = (tensor, j)

    def named(self, name: str, layer: bool) -> MegatronTensor | None:
        """The tensor Megatron saves as `name` (relative to its layer when `layer`)."""
        return self._named.get((layer, name))

    def holding(self, mp_name: str, layer: bool) -> tuple[MegatronTensor, int] | None:
        """(The tensor holding mp's `mp_name`, its place among the tensor's `mp`)."""
        return self._holding.get((layer, mp_name))


def megatron_view(settings: dict, family: Family | None = None) -> MegatronView:
    """The Megatron view of `family` (default: the one the settings describe) completed by
    the generic GPT table, for a model with these settings."""
    families.check_convertible(settings)
    family = family or families.family(families.family_of(settings))
    generic = gpt_model.RULES

    def names(rules) -> set[tuple[bool, str]]:
        return {(r.scope != "model", n) for r in rules for n in r.mp}

    excluded = names(r for r in generic if not r.applies(settings))
    rules = [r for r in family.rules
             if r.applies(settings) and not names([r]) & excluded]  # fmt: skip
    named = names(rules)
    rules += [r for r in generic if r.applies(settings) and not names([r]) & named]
    grouped: dict[tuple[bool, str], list[tuple[str, Scope]]] = {}
    for rule in rules:
        for mp_name in rule.mp:
            key = (rule.scope != "model", megatron_name(rule, mp_name))
            grouped.setdefault(key, []).append((mp_name, rule.scope))
    return MegatronView(tuple(_tensor(name, held) for (_, name), held in grouped.items()))


def _tensor(name: str, held: list[tuple[str, Scope]]) -> MegatronTensor:
    scope = held[0][1]
    module, _, part = name.rpartition(".")
    te = _TE_NORMS[module] + part if module in _TE_NORMS else None
    if len(held) == 1:
        return MegatronTensor(name, (held[0][0],), scope, te=te)
    # the pieces of one fused tensor: <mp module>.<piece>.<part> each
    pieces = {mp_name.rsplit(".", 2)[1]: mp_name for mp_name, _ in held}
    order = next((o for o in _FUSIONS if set(o) == set(pieces) and len(o) == len(held)), None)
    if order is None:
        raise ValueError(f"Megatron's {name} would hold {sorted(pieces.values())}: neither "
                         "q, k and v nor gate and up")  # fmt: skip
    mp = tuple(pieces[p] for p in order)
    dim = 1 if mp[0].startswith(_STACKED) else 0
    return MegatronTensor(name, mp, scope, _FUSIONS[order], dim)
