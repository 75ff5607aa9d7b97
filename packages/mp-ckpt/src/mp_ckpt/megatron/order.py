"""Megatron's parameter order: the order of a GPT model's `named_parameters()` (module
registration order), which fixes both the legacy optimizer's state indices and the
distributed optimizer's flat-buffer layout (there reversed).

    megatron_param_order(names) -> names sorted as Megatron's modules register them
"""

from __future__ import annotations

import re

from mp_ckpt.megatron.read import _LAYER

__all__ = ["megatron_param_order"]

# Order of a layer's parameters in Megatron's modules (registration order). A prefix ending
# in "." takes the suffixes of _SUFFIX_ORDER; another entry is a parameter's whole name. A
# hybrid model's Mamba layer: its mixer's own parameters (conv1d's, dt_bias, A_log, D)
# before its modules' (in_proj, the gated norm, out_proj), then the layer's norm (the local
# spec's; Transformer Engine's is in_proj's layer_norm_weight).
_LAYER_ORDER = (
    "input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
    "self_attention.q_layernorm.", "self_attention.k_layernorm.", "pre_mlp_layernorm.",
    "mlp.linear_fc1.", "mlp.linear_fc2.", "mlp.router.", "mlp.experts.",
    "mlp.shared_experts.gate_", "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
    "mixer.conv1d.", "mixer.conv1d_weight", "mixer.conv1d_bias",  # (the legacy files' names)
    "mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj.",
    "mixer.norm.", "mixer.out_proj.", "norm.",
)  # fmt: skip
# An expert's parameters, in the order of its number then its module (legacy names).
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_SUFFIX_ORDER = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")
_GLOBAL_ORDER = {
    "embedding.word_embeddings.weight": 0, "embedding.position_embeddings.weight": 1,
    "decoder.final_layernorm.weight": 3, "decoder.final_layernorm.bias": 4,
    "decoder.final_norm.weight": 3,
    "output_layer.weight": 5,
}  # fmt: skip


def _sort_key(name: str, where: str) -> tuple:
    match = _LAYER.match(name)
    if match is None:
        if name not in _GLOBAL_ORDER:
            raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")
        return (_GLOBAL_ORDER[name] if _GLOBAL_ORDER[name] < 2 else _GLOBAL_ORDER[name] + 1000,)
    rest = match.group(2)
    expert = _EXPERT.match(rest)
    if expert:
        position = _LAYER_ORDER.index("mlp.experts.")
        module = 0 if expert.group(2) == "linear_fc1" else 1
        suffix = _SUFFIX_ORDER.index(expert.group(3))
        return (2, int(match.group(1)), position, int(expert.group(1)), module, suffix)
    if rest == "mlp.shared_experts.gate_weight":
        return (2, int(match.group(1)), _LAYER_ORDER.index("mlp.shared_experts.gate_"), 0)
    for i, prefix in enumerate(_LAYER_ORDER):
        if rest == prefix:
            return (2, int(match.group(1)), i, 0)
        if rest.startswith(prefix) and rest[len(prefix) :] in _SUFFIX_ORDER:
            return (2, int(match.group(1)), i, _SUFFIX_ORDER.index(rest[len(prefix) :]))
    raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")


def megatron_param_order(names, where: str = "checkpoint") -> list[str]:
    """The names in Megatron's module (named_parameters) order."""
    return sorted(names, key=lambda n: _sort_key(n, where))
