"""Megatron's parameter order: the order of a GPT model's `named_parameters()` (module
registration order), which fixes both the legacy optimizer's state indices and the
distributed optimizer's flat-buffer layout (there reversed).

    megatron_param_order(names) -> names sorted as Megatron's modules register them

The model: the embedding, the decoder's layers and its final norm, the multi-token
prediction modules (each: enorm, hnorm, eh_proj, its layer, or a hybrid module's layers in
turn, final_layernorm), the output layer. Checked against megatron-core's recorded
optimizer layouts (packages/mp-ckpt/tests/test_megatron_import_optimizer.py).
"""

from __future__ import annotations

import re

from mp_ckpt.megatron.read import _LAYER

__all__ = ["megatron_param_order"]

# Order of a layer's parameters in Megatron's modules (registration order). A prefix ending
# in "." takes the suffixes of _SUFFIX_ORDER; another entry is a parameter's whole name.
# Multi-latent attention registers its core attention (with DeepSeek's sparse attention, the
# indexer: linear_wq_b, linear_wk, k_norm, linear_weights_proj), linear_proj, then its
# projections (linear_q_proj, or linear_q_down_proj and linear_q_up_proj;
# linear_kv_down_proj, linear_kv_up_proj), then its latent norms. A hybrid model's Mamba
# layer: its mixer's own parameters (conv1d's, dt_bias, A_log, D) before its modules'
# (in_proj, the gated norm, out_proj), then the layer's norm (the local spec's; Transformer
# Engine's is in_proj's layer_norm_weight). A gated DeltaNet (a layer's self_attention)
# registers dt_bias and A_log itself, before its modules in_proj, conv1d, out_norm and
# out_proj.
_LAYER_ORDER = (
    "input_layernorm.",
    "self_attention.dt_bias", "self_attention.A_log", "self_attention.in_proj.",
    "self_attention.conv1d.", "self_attention.out_norm.", "self_attention.out_proj.",
    "self_attention.core_attention.indexer.linear_wq_b.",
    "self_attention.core_attention.indexer.linear_wk.",
    "self_attention.core_attention.indexer.k_norm.",
    "self_attention.core_attention.indexer.linear_weights_proj.",
    "self_attention.linear_proj.", "self_attention.linear_qkv.",
    "self_attention.linear_q_proj.", "self_attention.linear_q_down_proj.",
    "self_attention.linear_q_up_proj.", "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.q_layernorm.", "self_attention.k_layernorm.",
    "self_attention.kv_layernorm.", "pre_mlp_layernorm.",
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
    "output_layer.weight": 6,
}  # fmt: skip
_MTP_PLACE = 5  # the multi-token prediction modules: after the decoder, before the output
# A module's parameters: its own norms and projection around its layer (or layers)
_MTP_OWN = {"enorm": 0, "hnorm": 1, "eh_proj": 2, "final_layernorm": 4}
_MTP = re.compile(
    r"^mtp\.layers\.(\d+)\.(?:(enorm|hnorm|eh_proj|final_layernorm)\.(weight|bias)"
    r"|(?:transformer_layer|mtp_model_layer)\.(?:layers\.(\d+)\.)?(.+))$"
)


def _layer_key(rest: str, name: str, where: str) -> tuple:
    """The place of a layer's parameter (its name relative to the layer) in its layer."""
    expert = _EXPERT.match(rest)
    if expert:
        position = _LAYER_ORDER.index("mlp.experts.")
        module = 0 if expert.group(2) == "linear_fc1" else 1
        suffix = _SUFFIX_ORDER.index(expert.group(3))
        return (position, int(expert.group(1)), module, suffix)
    if rest == "mlp.shared_experts.gate_weight":
        return (_LAYER_ORDER.index("mlp.shared_experts.gate_"), 0)
    for i, prefix in enumerate(_LAYER_ORDER):
        if rest == prefix:
            return (i, 0)
        if rest.startswith(prefix) and rest[len(prefix) :] in _SUFFIX_ORDER:
            return (i, _SUFFIX_ORDER.index(rest[len(prefix) :]))
    raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")


def _sort_key(name: str, where: str) -> tuple:
    match = _LAYER.match(name)
    if match is not None:
        return (2, int(match.group(1)), *_layer_key(match.group(2), name, where))
    mtp = _MTP.match(name)
    if mtp is not None:
        module = (_MTP_PLACE, int(mtp.group(1)))
        if mtp.group(2):
            return (*module, _MTP_OWN[mtp.group(2)], _SUFFIX_ORDER.index(mtp.group(3)))
        sublayer = int(mtp.group(4) or 0)  # a hybrid module's layers in turn
        return (*module, 3, sublayer, *_layer_key(mtp.group(5), name, where))
    if name not in _GLOBAL_ORDER:
        raise ValueError(f"{where}: {name}: unknown place in Megatron's parameter order")
    return (_GLOBAL_ORDER[name],)


def megatron_param_order(names, where: str = "checkpoint") -> list[str]:
    """The names in Megatron's module (named_parameters) order."""
    return sorted(names, key=lambda n: _sort_key(n, where))
