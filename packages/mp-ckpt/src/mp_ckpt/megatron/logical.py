"""Megatron's tensors (read whole, under its names and fused layouts) -> mp's logical
tensors (mp-layers' names), unfused, as the family tables' Megatron view says
(mp_ckpt.families.megatron_view: the table of the family the settings describe,
completed by the table of every tensor mp's GPTModel can have):

    linear_qkv.weight [groups x (heads/groups + 2) x d, h]
        -> linear_qkv.q [groups, heads/groups, d, h], .k / .v [groups, d, h]
    linear_fc1.weight (SwiGLU) [gate; up] -> linear_fc1.gate, linear_fc1.up
    linear_qkv.layer_norm_weight (TE spec) -> input_layernorm.weight
    linear_fc1.layer_norm_weight (TE spec) -> pre_mlp_layernorm.weight

Multi-latent attention's projections keep their names (mp's are Megatron's local
spec's); the TE spec's latent norms linear_q_up_proj.layer_norm_weight and
linear_kv_up_proj.layer_norm_weight are q_layernorm.weight and kv_layernorm.weight. A
norm held under both specs' names (as export-megatron writes them) is read once, after
checking that the two are equal.

A mixture-of-experts layer (mlp.router.weight, mlp.router.expert_bias, the shared
expert's linear_fc1 / linear_fc2 / gate_weight keep their names):

    mlp.experts.experts.linear_fc1.weight [E, 2F, h] (torch_dist: the experts stacked
        by global number; the legacy format's mlp.experts.local_experts.<e>.* are
        stacked the same way) -> mlp.experts.linear_fc1.gate / .up [E, F, h]
    mlp.experts.experts.linear_fc2.weight [E, h, F] -> mlp.experts.linear_fc2.weight

A tensor the view does not name is refused by name.
"""

from __future__ import annotations

import functools
import re

import torch

from mp_ckpt.families.megatron_view import megatron_view, split_name
from mp_ckpt.families.table import Dims
from mp_ckpt.megatron.read import _LAYER, MegatronModel, MegatronTensors
from mp_ckpt.megatron.settings import held_mtp_modules, model_config_from_megatron

__all__ = ["logical_from_megatron", "logical_plan", "stack_experts"]

# One expert's tensor: the legacy format's local_experts.<e> (numbered globally by
# read.py), or torch_dist's experts.experts.<e> (singleton_local_shards)
_ONE_EXPERT = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer\.layers\.\d+))"
    r"\.mlp\.experts\.)"
    r"(?:local_experts|experts)\.(\d+)\.(.+)$"
)
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.")


def logical_from_megatron(
    model: MegatronModel, sources: dict[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(mp's logical tensors, mp's model settings) of a Megatron checkpoint read whole;
    `sources`, when given, is filled with each logical key's Megatron key (the experts'
    stacked under torch_dist's name)."""
    plan, settings = logical_plan(model, sources)
    return {key: produce() for key, (_, _, produce) in plan.items()}, settings


def _shape(tensors, key: str) -> tuple[int, ...]:
    return tensors.shape(key) if isinstance(tensors, MegatronTensors) else tuple(tensors[key].shape)


def _dtype(tensors, key: str) -> torch.dtype:
    return tensors.dtype(key) if isinstance(tensors, MegatronTensors) else tensors[key].dtype


def logical_plan(
    model: MegatronModel, sources: dict[str, str] | None = None
) -> tuple[dict[str, tuple], dict]:
    """({mp's logical key: (shape, dtype, produce)}, mp's model settings): produce() reads
    the one Megatron tensor the logical tensor comes from and cuts it, so that the tensors
    can be made (and written) one at a time; `sources` as logical_from_megatron's."""
    where = str(model.directory)
    tensors = stack_experts(model.tensors, where)
    if "embedding.word_embeddings.weight" not in tensors:
        raise KeyError(f"{where}: no embedding.word_embeddings.weight")
    vocab_size = _shape(tensors, "embedding.word_embeddings.weight")[0]
    settings = model_config_from_megatron(model.args, vocab_size, f"{where} args")
    view, dims = megatron_view(settings), Dims.of(settings)
    tied = not settings["untie_embeddings_and_output_weights"]
    plan: dict[str, tuple] = {}
    sources = {} if sources is None else sources  # logical key -> the Megatron key read

    def add(name: str, key: str, shape, cut=None) -> None:
        def produce() -> torch.Tensor:
            tensor = tensors[key]
            return tensor if cut is None else cut(tensor).contiguous()

        if name in plan:  # the same tensor under a second name
            produce = functools.partial(_same, sources[name], plan[name][2], key, produce, where)
        sources.setdefault(name, key)
        plan[name] = (tuple(shape), _dtype(tensors, key), produce)

    for key in tensors:
        prefix, rest, place = split_name(key)
        held = view.named(rest, place)
        if held is None:
            raise ValueError(f"{where}: {key}: no place for this tensor in mp's GPTModel")
        if key == "output_layer.weight" and tied:
            continue  # a tied copy
        try:
            shapes = held.mp_shapes(_shape(tensors, key), dims)
        except ValueError as error:
            raise ValueError(f"{where}: {key} {error}") from None
        for j, (name, shape) in enumerate(zip(held.mp, shapes, strict=True)):
            cut = None if held.fusion is None else functools.partial(held.cut, j=j, dims=dims)
            add(prefix + name, key, shape, cut)
    layers = {int(m.group(1)) for k in plan if (m := _LAYER.match(k))}
    if layers != set(range(settings["num_layers"])):
        raise ValueError(
            f"{where}: the tensors hold layers {sorted(layers)}, args num_layers="
            f"{settings['num_layers']}"
        )
    modules = {int(m.group(1)) for k in plan if (m := _MTP.match(k))}
    held = held_mtp_modules(settings)
    if modules != set(range(held)):
        repeated = " with mtp_use_repeated_layer (one module)" if held == 1 else ""
        raise ValueError(
            f"{where}: the tensors hold multi-token prediction modules {sorted(modules)}, "
            f"args mtp_num_layers={settings.get('mtp_num_layers')}{repeated}"
        )
    return plan, settings


def _same(first: str, read_first, second: str, read_second, where: str) -> torch.Tensor:
    tensor = read_first()
    if not torch.equal(tensor, read_second()):
        raise ValueError(f"{where}: {first} and {second} hold the same tensor of mp's "
                         "GPTModel but differ")  # fmt: skip
    return tensor


def stack_experts(tensors, where: str) -> MegatronTensors:
    """The tensors with each layer's per-expert tensors (legacy local_experts.<e>, or
    torch_dist's experts.experts.<e>) stacked into one [experts, ...] tensor under
    torch_dist's name mlp.experts.experts.<rest>, read expert by expert when looked up."""
    out = MegatronTensors()
    groups: dict[str, dict[int, str]] = {}
    for key in tensors:
        match = _ONE_EXPERT.match(key)
        if match is None:
            out.add(key, _shape(tensors, key), _dtype(tensors, key),
                    lambda k=key: tensors[k])  # fmt: skip
        else:
            name = f"{match.group(1)}experts.{match.group(3)}"
            groups.setdefault(name, {})[int(match.group(2))] = key
    for name, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"{where}: {name}: experts {sorted(by_expert)} are not 0..E-1")
        keys = [by_expert[e] for e in range(len(by_expert))]
        shapes = {_shape(tensors, k) for k in keys}
        if len(shapes) != 1:
            raise ValueError(f"{where}: {name}: the experts' shapes differ: {sorted(shapes)}")
        out.add(name, (len(keys), *shapes.pop()), _dtype(tensors, keys[0]),
                lambda ks=keys: torch.stack([tensors[k] for k in ks]))  # fmt: skip
    return out
