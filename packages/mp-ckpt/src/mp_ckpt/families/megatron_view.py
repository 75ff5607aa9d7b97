"""The family tables seen from Megatron-LM: each Megatron tensor, the mp tensors it holds
and how they are fused there.

    megatron_view(settings, family=None) -> MegatronView
        .named(name, where)      the MegatronTensor Megatron stores as `name` (or under
                                 its Transformer Engine alias), or None
        .holding(mp_name, where) (the MegatronTensor holding mp's tensor, its index), or None
        .tensors                 every one
    split_name(key) -> (prefix, name, where)   a full key as the view looks it up

A Megatron checkpoint records no family: the view is the table of the family the
settings describe (`family_of`), completed by gpt_model.py's table of every tensor mp's
GPTModel can have for the tensors the family does not name; with multi-latent attention
that table alone (it names all of a DeepSeek-shaped model under Megatron's names; the
DeepSeek families add Hugging Face names and copies Megatron does not keep). A family
rule for a tensor the settings' model cannot have (gate and up where the MLP is not
gated) is left out. Names are relative to "decoder.layers.{i}." except in the "model"
scope, as in the tables; `where` is "layer" (a decoder layer's, or a multi-token
prediction module's transformer layer's, under "mtp.layers.{k}.transformer_layer.", or
a hybrid module's layer's, under "mtp.layers.{k}.mtp_model_layer.layers.{j}."),
"mtp" (a multi-token prediction module's own, under "mtp.layers.{k}.") or "model".

How mp's tensors are fused ([groups, heads per group, d, ...] q, [groups, d, ...] k and
v; E the experts, F an MLP's width, h the hidden size):

    "qkv"  linear_qkv [groups x (heads per group + 2) x d, ...]: per query group its
           query heads, then its key, then its value (Megatron's interleaving)
    "glu"  a gated fc1 [gate; up]: [2F, h] on dim 0, the experts' [E, 2F, h] on dim 1
           (with attention_output_gate: its query heads, as many gate heads, k, v)
    "mamba" a Mamba mixer's in_proj [z; x; B; C; dt] or conv1d [x; B; C] (weight
           [rows, 1, K] and bias): mp's parts mixer.in_proj.{z,x,B,C,dt}.weight and
           mixer.conv1d.{x,B,C}.{weight,bias}, each [G, rows of a group, ...] (the same
           memory order; conv1d's weight without its channel dim of 1). torch_dist keeps
           the parts as keys of their own (X.z, X.x, ...; `split_parts`)
    "gdn"  a gated DeltaNet's in_proj [query; key; value; z; beta; alpha] or conv1d
           [query; key; value], each part whole over its heads: mp's parts
           self_attention.in_proj.<part>.weight and self_attention.conv1d.<part>.weight,
           each [Hk, rows of a key head, ...]; torch_dist keeps the parts apart as for
           "mamba"
    None   one mp tensor, as it is (perhaps renamed)

Transformer Engine's layer specs fuse a layer's norms into the next linear layer:
input_layernorm is saved as self_attention.linear_qkv.layer_norm_*, pre_mlp_layernorm
as mlp.linear_fc1.layer_norm_* (`te`); a gated DeltaNet layer's input_layernorm as
self_attention.in_proj.layer_norm_* (an alias: a torch_dist export writes it beside the
attention layers' name, which Megatron's load leaves where it does not ask for it).
Megatron's local spec saves them under these names too in torch_dist (its
sharded_state_dict_keys_map), so `dist` is `te`.

A hybrid model (HybridModel, Transformer Engine's spec, the only one megatron-core builds
it with by default) fuses each layer's norm into the next linear layer: a Mamba layer's
norm.weight as mixer.in_proj.layer_norm_weight, an attention layer's and an MLP layer's
as above, while a MoE layer keeps pre_mlp_layernorm apart. The local hybrid spec
(post_training.modelopt) saves the layers' own names in the legacy format and the TE
names in torch_dist. Both are read; a torch_dist export writes both names (`dist`), as
for multi-latent attention.

Multi-latent attention differs (megatron-core's gpt_layer_specs): the local spec keeps
every module's own name in torch_dist (input_layernorm, pre_mlp_layernorm, q_layernorm,
kv_layernorm: no keys map), while the TE spec keeps input_layernorm (and an MoE layer's
pre_mlp_layernorm) apart and fuses the latent norms into the up projections,
q_layernorm as self_attention.linear_q_up_proj.layer_norm_*, kv_layernorm as
self_attention.linear_kv_up_proj.layer_norm_*, and a dense layer's pre-MLP norm into
mlp.linear_fc1.layer_norm_*. Both are read; `dist` holds both names, so that a
torch_dist export loads into either spec (a torch_dist load reads the keys its model
asks for and leaves the others).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mp_ckpt import families
from mp_ckpt.families import gpt_model
from mp_ckpt.families.table import Dims, Family, Rule, Scope, has_gated_delta_net_layers

__all__ = ["MegatronTensor", "MegatronView", "megatron_name", "megatron_view", "split_name"]

Fusion = Literal["qkv", "glu", "mamba", "gdn"]
Where = Literal["model", "layer", "mtp"]
_LAYER_KEY = re.compile(
    r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer\.layers\.\d+)\.)"
    r"(.+)$"
)
_MTP_KEY = re.compile(r"^(mtp\.layers\.\d+\.)(.+)$")
_FUSIONS: dict[tuple[str, ...], Fusion] = {
    ("q", "k", "v"): "qkv", ("gate", "up"): "glu",
    ("z", "x", "B", "C", "dt"): "mamba", ("x", "B", "C"): "mamba",
    ("q", "gate", "k", "v"): "qkv",
    ("query", "key", "value", "z", "beta", "alpha"): "gdn", ("query", "key", "value"): "gdn",
}  # fmt: skip
# mp keeps the experts stacked on dim 0: their [gate; up] is on dim 1
_STACKED = "mlp.experts."
_TE_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_",
             "norm": "mixer.in_proj.layer_norm_"}  # fmt: skip
"""A layer's norm -> the Transformer Engine linear layer it is fused into ("norm": a hybrid
model's Mamba layer's; no other layer has one of that name)."""
_MLA_TE_NORMS = {
    "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_",
    "self_attention.q_layernorm": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj.layer_norm_",
}


def split_name(key: str) -> tuple[str, str, Where]:
    """(prefix, the name the view knows, where) of a full key (module docstring)."""
    for pattern, where in ((_LAYER_KEY, "layer"), (_MTP_KEY, "mtp")):
        match = pattern.match(key)
        if match:
            return match.group(1), match.group(2), where
    return "", key, "model"


def _where(scope: Scope) -> Where:
    if scope == "mtp_last":  # a multi-token prediction module's own tensor, as "mtp"
        return "mtp"
    return scope if scope in ("model", "mtp") else "layer"


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
    aliases: tuple[str, ...] = ()
    """More names it is read under, each layer kind's own (a gated DeltaNet layer's input
    norm: self_attention.in_proj.layer_norm_*, where an attention layer's is te)."""
    dist: tuple[str, ...] = ()
    """The names a torch_dist save holds it under (module docstring); () for `name`."""

    @property
    def dist_names(self) -> tuple[str, ...]:
        return self.dist or (self.name,)

    @property
    def split_parts(self) -> tuple[str, ...]:
        """The parts torch_dist keeps as keys of their own, `name`.<part> (a Mamba mixer's
        or a gated DeltaNet's fused tensors); () for none."""
        if self.fusion not in ("mamba", "gdn"):
            return ()
        return tuple(mp_name.rsplit(".", 2)[1] for mp_name in self.mp)

    def part_rows(self, dims: Dims) -> list[int]:
        """The rows of each part of a "mamba" or "gdn" fusion, in `mp` order."""
        if self.fusion == "gdn":
            keys = dims.linear_key_heads * dims.linear_key_dim
            values = dims.linear_value_heads * dims.linear_value_dim
            heads = dims.linear_value_heads
            rows = {"query": keys, "key": keys, "value": values, "z": values, "beta": heads,
                    "alpha": heads}  # fmt: skip
            return [rows[part] for part in self.split_parts]
        inner = dims.mamba_heads * dims.mamba_head_dim
        states = dims.mamba_groups * dims.mamba_state
        rows = {"z": inner, "x": inner, "B": states, "C": states, "dt": dims.mamba_heads}
        return [rows[part] for part in self.split_parts]

    def _groups(self, dims: Dims) -> int:
        """The groups mp's parts of a "mamba" or "gdn" fusion are viewed by: the Mamba
        groups, or the DeltaNet's key heads."""
        return dims.linear_key_heads if self.fusion == "gdn" else dims.mamba_groups

    def mp_shapes(self, shape: Sequence[int], dims: Dims) -> list[tuple[int, ...]]:
        """The shapes of mp's tensors cut from a Megatron tensor of `shape`."""
        shape = tuple(shape)
        if self.fusion is None:
            return [shape]
        if self.fusion in ("mamba", "gdn"):
            rows, groups = self.part_rows(dims), self._groups(dims)
            if shape[0] != sum(rows) or any(n % groups for n in rows):
                kind = "Mamba" if self.fusion == "mamba" else "gated DeltaNet"
                raise ValueError(f"has {shape[0]} rows; the {kind} widths make {rows} in "
                                 f"{groups} groups")  # fmt: skip
            tail = _conv_tail(shape)
            return [(groups, n // groups, *tail) for n in rows]
        if self.fusion == "glu":
            first, second = list(shape), list(shape)
            first[self.dim] -= shape[self.dim] // 2  # torch.chunk's first half
            second[self.dim] = shape[self.dim] // 2
            return [tuple(first), tuple(second)]
        groups, per_group, d, tail = dims.groups, dims.per_group, dims.head_dim, shape[1:]
        gates = per_group if len(self.mp) == 4 else 0  # attention's output gate
        expected = groups * (per_group + gates + 2) * d
        if shape[0] != expected:
            what = " (+ as many gates, k, v)" if gates else " (+ k, v)"
            raise ValueError(
                f"has {shape[0]} rows; {groups} query groups of {per_group} heads{what} "
                f"of {d} channels make {expected}"
            )
        heads = [(groups, per_group, d, *tail)] * (2 if gates else 1)
        return [*heads, (groups, d, *tail), (groups, d, *tail)]

    def cut(self, tensor: torch.Tensor, j: int, dims: Dims) -> torch.Tensor:
        """mp's j-th tensor (a view) of the Megatron tensor."""
        if self.fusion is None:
            return tensor
        if self.fusion == "glu":
            return tensor.chunk(2, dim=self.dim)[j]
        if self.fusion in ("mamba", "gdn"):
            part = tensor.split(self.part_rows(dims))[j]
            return part.reshape(self._groups(dims), -1, *_conv_tail(tensor.shape))
        pg = dims.per_group
        gates = pg if len(self.mp) == 4 else 0
        fused = tensor.reshape(dims.groups, pg + gates + 2, dims.head_dim, *tensor.shape[1:])
        if j == 0:
            return fused[:, :pg]
        if gates and j == 1:
            return fused[:, pg : pg + gates]
        return fused[:, pg + gates + j - (2 if gates else 1)]

    def fuse(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The Megatron tensor from mp's (in `mp` order); the inverse of `cut`."""
        if self.fusion is None:
            (tensor,) = tensors
            return tensor
        if self.fusion == "glu":
            return torch.cat(list(tensors), dim=self.dim).contiguous()
        if self.fusion in ("mamba", "gdn"):
            whole = torch.cat([t.reshape(-1, *t.shape[2:]) for t in tensors])
            # conv1d's weight [channels, 1, K] (a depthwise Conv1d's)
            conv = self.name.endswith("conv1d.weight") and whole.dim() == 2
            return (whole.unsqueeze(1) if conv else whole).contiguous()
        *heads, k, v = tensors  # q, or q and the gate
        whole = torch.cat([*heads, k.unsqueeze(1), v.unsqueeze(1)], dim=1)
        return whole.reshape(-1, *heads[0].shape[3:]).contiguous()


def _conv_tail(shape: Sequence[int]) -> tuple[int, ...]:
    """The dims after the rows of mp's part of a fused Mamba tensor of `shape`: conv1d's
    weight [rows, 1, K] gives (K,), in_proj's weight [rows, h] gives (h,), a bias ()."""
    tail = tuple(shape[1:])
    return tail[1:] if len(tail) == 2 and tail[0] == 1 else tail


class MegatronView:
    """Megatron's tensors of a model, looked up by their name or by an mp tensor's."""

    def __init__(self, tensors: Sequence[MegatronTensor]) -> None:
        self.tensors = tuple(tensors)
        self._named: dict[tuple[Where, str], MegatronTensor] = {}
        self._holding: dict[tuple[Where, str], tuple[MegatronTensor, int]] = {}
        for tensor in self.tensors:
            where = _where(tensor.scope)
            for name in (tensor.name, tensor.te, *tensor.aliases):
                if name is not None:
                    self._named[(where, name)] = tensor
            for j, mp_name in enumerate(tensor.mp):
                self._holding[(where, mp_name)] = (tensor, j)

    def named(self, name: str, where: Where) -> MegatronTensor | None:
        """The tensor Megatron saves as `name` (relative to its layer or module, `where`)."""
        return self._named.get((where, name))

    def holding(self, mp_name: str, where: Where) -> tuple[MegatronTensor, int] | None:
        """(The tensor holding mp's `mp_name`, its place among the tensor's `mp`)."""
        return self._holding.get((where, mp_name))


def megatron_view(settings: dict, family: Family | None = None) -> MegatronView:
    """The Megatron view of `family` (default: the one the settings describe) completed by
    the generic GPT table, for a model with these settings."""
    mla = bool(settings.get("multi_latent_attention"))
    if family is None and not mla:
        family = families.family(families.family_of(settings))
    generic = gpt_model.RULES

    def names(rules) -> set[tuple[Where, str]]:
        return {(_where(r.scope), n) for r in rules for n in r.mp}

    excluded = names(r for r in generic if not r.applies(settings))
    rules = [r for r in (family.rules if family else ())
             if r.applies(settings) and not names([r]) & excluded]  # fmt: skip
    named = names(rules)
    rules += [r for r in generic if r.applies(settings) and not names([r]) & named]
    grouped: dict[tuple[Where, str], list[tuple[str, Scope]]] = {}
    for rule in rules:
        for mp_name in rule.mp:
            key = (_where(rule.scope), megatron_name(rule, mp_name))
            held = grouped.setdefault(key, [])
            if all(mp_name != name for name, _ in held):  # one tensor of several layer kinds
                held.append((mp_name, rule.scope))
    both = mla or bool(settings.get("hybrid_layer_pattern"))
    pattern = settings.get("hybrid_layer_pattern") or ""
    gdn = has_gated_delta_net_layers(settings) or "G" in pattern
    return MegatronView(
        tuple(_tensor(name, held, mla, both, gdn) for (_, name), held in grouped.items())
    )


def _tensor(
    name: str, held: list[tuple[str, Scope]], mla: bool, both: bool, gdn: bool = False
) -> MegatronTensor:
    """both: torch_dist holds a fused norm under both names (module docstring); gdn: the
    model has gated DeltaNet layers, whose input norm TE fuses into in_proj."""
    scope = held[0][1]
    module, _, part = name.rpartition(".")
    te_norms = _MLA_TE_NORMS if mla else _TE_NORMS
    te = te_norms[module] + part if module in te_norms else None
    if len(held) == 1:
        dist = (name, te) if both and te else (te or name,)
        aliases = ()
        if gdn and module == "input_layernorm":  # a DeltaNet layer's TE name as well
            aliases = (f"self_attention.in_proj.layer_norm_{part}",)
            dist = (*dist, *aliases)
        return MegatronTensor(name, (held[0][0],), scope, te=te, dist=dist, aliases=aliases)
    # the pieces of one fused tensor: <mp module>.<piece>.<part> each
    pieces = {mp_name.rsplit(".", 2)[1]: mp_name for mp_name, _ in held}
    order = next((o for o in _FUSIONS if set(o) == set(pieces) and len(o) == len(held)), None)
    if order is None:
        raise ValueError(f"Megatron's {name} would hold {sorted(pieces.values())}: neither "
                         "q, k and v (and a gate), gate and up, nor a Mamba mixer's or gated "
                         "DeltaNet's parts")  # fmt: skip
    mp = tuple(pieces[p] for p in order)
    dim = 1 if mp[0].startswith(_STACKED) else 0
    return MegatronTensor(name, mp, scope, _FUSIONS[order], dim)
