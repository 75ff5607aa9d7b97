"""Megatron's tensors (read whole, under its names and fused layouts) -> mp's logical
tensors (mp-layers' names), unfused:

    linear_qkv.weight [groups x (heads/groups + 2) x d, h]
        -> linear_qkv.q [groups, heads/groups, d, h], .k / .v [groups, d, h]
    linear_fc1.weight (SwiGLU) [gate; up] -> linear_fc1.gate, linear_fc1.up
    linear_qkv.layer_norm_weight (TE spec) -> input_layernorm.weight
    linear_fc1.layer_norm_weight (TE spec) -> pre_mlp_layernorm.weight

A mixture-of-experts layer (mlp.router.weight, mlp.router.expert_bias, the shared
expert's linear_fc1 / linear_fc2 / gate_weight keep their names):

    mlp.experts.experts.linear_fc1.weight [E, 2F, h] (torch_dist: the experts stacked
        by global number; the legacy format's mlp.experts.local_experts.<e>.* are
        stacked the same way) -> mlp.experts.linear_fc1.gate / .up [E, F, h]
    mlp.experts.experts.linear_fc2.weight [E, h, F] -> mlp.experts.linear_fc2.weight
"""

from __future__ import annotations

import re

import torch

from mp_ckpt.megatron.read import _LAYER, MegatronModel, MegatronTensors
from mp_ckpt.megatron.settings import model_config_from_megatron

__all__ = ["TE_NORM_NAMES", "logical_from_megatron", "logical_plan", "stack_experts"]

TE_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_KEPT = {
    "input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias", "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "self_attention.core_attention.softmax_offset", "mlp.router.weight", "mlp.router.bias",
    "mlp.router.expert_bias", "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.gate_weight",
}  # fmt: skip
# A layer's fc1 tensors (a SwiGLU one is [gate; up] on `dim`) -> mp's name for them.
_FC1 = {
    "mlp.linear_fc1.": ("mlp.linear_fc1.", 0),
    "mlp.shared_experts.linear_fc1.": ("mlp.shared_experts.linear_fc1.", 0),
    "mlp.experts.experts.linear_fc1.": ("mlp.experts.linear_fc1.", 1),  # [experts, 2F, h]
}
_EXPERTS_FC2 = "mlp.experts.experts.linear_fc2."
# One expert's tensor: the legacy format's local_experts.<e> (numbered globally by
# read.py), or torch_dist's experts.experts.<e> (singleton_local_shards)
_ONE_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.mlp\.experts\.)(?:local_experts|experts)\.(\d+)\.(.+)$"
)
_GLOBAL = {
    "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
}  # fmt: skip


def logical_from_megatron(model: MegatronModel) -> tuple[dict[str, torch.Tensor], dict]:
    """(mp's logical tensors, mp's model settings) of a Megatron checkpoint read whole."""
    plan, settings = logical_plan(model)
    return {key: produce() for key, (_, _, produce) in plan.items()}, settings


def _shape(tensors, key: str) -> tuple[int, ...]:
    return tensors.shape(key) if isinstance(tensors, MegatronTensors) else tuple(tensors[key].shape)


def _dtype(tensors, key: str) -> torch.dtype:
    return tensors.dtype(key) if isinstance(tensors, MegatronTensors) else tensors[key].dtype


def logical_plan(model: MegatronModel) -> tuple[dict[str, tuple], dict]:
    """({mp's logical key: (shape, dtype, produce)}, mp's model settings): produce() reads
    the one Megatron tensor the logical tensor comes from and cuts it, so that the tensors
    can be made (and written) one at a time."""
    where = str(model.directory)
    tensors = stack_experts(model.tensors, where)
    if "embedding.word_embeddings.weight" not in tensors:
        raise KeyError(f"{where}: no embedding.word_embeddings.weight")
    vocab_size = _shape(tensors, "embedding.word_embeddings.weight")[0]
    settings = model_config_from_megatron(model.args, vocab_size, f"{where} args")
    heads, groups = settings["num_attention_heads"], settings["num_query_groups"]
    d, per_group = settings["kv_channels"], heads // groups
    plan: dict[str, tuple] = {}

    def add(name: str, key: str, shape, cut=None) -> None:
        def produce() -> torch.Tensor:
            tensor = tensors[key]
            return tensor if cut is None else cut(tensor).contiguous()

        plan[name] = (tuple(shape), _dtype(tensors, key), produce)

    for key in tensors:
        shape = _shape(tensors, key)
        match = _LAYER.match(key)
        if match is None:
            if key not in _GLOBAL:
                raise ValueError(f"{where}: {key}: no place for this tensor in mp's GPTModel")
            if key == "output_layer.weight" and not settings["untie_embeddings_and_output_weights"]:
                continue  # a tied copy
            add(key, key, shape)
            continue
        prefix, rest = f"decoder.layers.{match.group(1)}.", match.group(2)
        if rest in TE_NORM_NAMES:
            add(prefix + TE_NORM_NAMES[rest], key, shape)
        elif rest in _KEPT:
            add(prefix + rest, key, shape)
        elif rest.startswith("self_attention.linear_qkv."):
            part = rest.rsplit(".", 1)[1]
            tail = tuple(shape[1:])
            expected = groups * (per_group + 2) * d
            if shape[0] != expected:
                raise ValueError(
                    f"{where}: {key} has {shape[0]} rows; {groups} query groups of "
                    f"{per_group} heads (+ k, v) of {d} channels make {expected}"
                )
            qkv = prefix + "self_attention.linear_qkv."
            fused = (groups, per_group + 2, d, *tail)
            add(
                f"{qkv}q.{part}",
                key,
                (groups, per_group, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, :n],
            )
            add(
                f"{qkv}k.{part}",
                key,
                (groups, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, n],
            )
            add(
                f"{qkv}v.{part}",
                key,
                (groups, d, *tail),
                lambda t, f=fused, n=per_group: t.reshape(f)[:, n + 1],
            )
        elif (fc1 := rest.rsplit(".", 1)[0] + ".") in _FC1:
            part = rest.rsplit(".", 1)[1]
            name, dim = _FC1[fc1]
            if settings["activation"] == "swiglu" or settings.get("quick_geglu"):
                first, second = list(shape), list(shape)
                first[dim] -= shape[dim] // 2  # torch.chunk's first half
                second[dim] = shape[dim] // 2
                add(f"{prefix}{name}gate.{part}", key, first,
                    lambda t, d=dim: t.chunk(2, dim=d)[0])  # fmt: skip
                add(f"{prefix}{name}up.{part}", key, second,
                    lambda t, d=dim: t.chunk(2, dim=d)[1])  # fmt: skip
            else:
                add(f"{prefix}{name}{part}", key, shape)
        elif rest.startswith(_EXPERTS_FC2):
            add(f"{prefix}mlp.experts.linear_fc2.{rest.rsplit('.', 1)[1]}", key, shape)
        else:
            raise ValueError(f"{where}: {key}: no place for this tensor in mp's GPTModel")
    layers = {int(m.group(1)) for k in plan if (m := _LAYER.match(k))}
    if layers != set(range(settings["num_layers"])):
        raise ValueError(
            f"{where}: the tensors hold layers {sorted(layers)}, args num_layers="
            f"{settings['num_layers']}"
        )
    return plan, settings


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
