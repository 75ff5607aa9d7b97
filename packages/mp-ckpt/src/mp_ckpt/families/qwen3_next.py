"""Qwen3-Next (model_type "qwen3_next", Qwen3NextForCausalLM): layers of gated DeltaNet
linear attention ("linear_attention" in layer_types) or gated softmax attention
("full_attention"), each followed by a mixture of experts with a sigmoid-gated shared
expert (Qwen2-MoE's) or, in mlp_only_layers, a dense SwiGLU MLP. Every norm scales by
1 + weight (mp's apply_layernorm_1p), the queries and keys too (Qwen3's q_norm, k_norm);
rotary embeddings rotate the first partial_rotary_factor of each head (rotary_percent).
mp's settings are Megatron's: experimental_attention_variant "gdn", linear_attention_freq
one 0/1 per layer, the linear_* widths, attention_output_gate.

Hugging Face (model.layers.{i}.)           mp (decoder.layers.{i}.)
    self_attn.q_proj.weight [H x 2d, h]    self_attention.linear_qkv.{q,gate}.weight
        each head's d query rows then its     [groups, heads per group, d, h] each
        d gate rows
    self_attn.{k,v,o}_proj, {q,k}_norm     as Qwen3's (llama_style.py)
    linear_attn.in_proj_qkvz.weight        self_attention.in_proj.{query,key,value,z}.weight
        [Hk (2 dk + 2 r dv), h]: per key      [Hk, dk | dk | r dv | r dv, h]
        head its q, k, v, z rows
    linear_attn.in_proj_ba.weight          self_attention.in_proj.{beta,alpha}.weight
        [Hk 2r, h]: per key head b, a         [Hk, r, h]
    linear_attn.conv1d.weight              self_attention.conv1d.{query,key,value}.weight
        [2 Hk dk + Hv dv, 1, K]: all q          [Hk, dk | dk | r dv, K]
        channels, then k's, then v's
    linear_attn.dt_bias, A_log [Hv]        self_attention.dt_bias, A_log
    linear_attn.norm.weight [dv]           self_attention.out_norm.weight = weight - 1 (the
                                              gated norm scales by its weight, mp's by 1 + w)
    linear_attn.out_proj.weight            self_attention.out_proj.weight
    mlp.gate / experts / shared_expert / shared_expert_gate    as Qwen2-MoE's (moe.py)
Hk key heads of dk channels, Hv = r Hk value heads of dv channels, K the convolution width.

Multi-token prediction (Qwen3-Next's released weights hold one module, which transformers
neither builds nor loads; vLLM computes it as h' = layer(fc(cat(pre_fc_norm_embedding(e),
pre_fc_norm_hidden(h)))), logits lm_head(norm(h'))): mp's mtp.layers.0 (mtp_num_layers 1,
from the weights: `held`), its transformer layer shaped as the model's last, a gated
softmax-attention layer:

    mtp.pre_fc_norm_embedding.weight, pre_fc_norm_hidden.weight    enorm, hnorm
    mtp.fc.weight [h, 2h]                                           eh_proj (cat(e, h))
    mtp.layers.0.<a decoder layer's names>                          transformer_layer.*
    mtp.norm.weight                                                 final_layernorm

Refused: a model whose last layer is a gated DeltaNet (the module's layer is softmax
attention), and more than one module (Qwen3-Next's layout has one fc and set of norms).

config.json -> settings: layer_types (or full_attention_interval, transformers' default 4)
-> linear_attention_freq; linear_conv_kernel_dim, linear_{key,value}_head_dim,
linear_num_{key,value}_heads -> the same names; partial_rotary_factor (in rope_parameters
or at the top, default 0.25) -> rotary_percent; num_experts 0 (a dense model) is refused.
"""

from __future__ import annotations

import re

import torch

from mp_ckpt.families.hf_settings import llama_settings, refuse
from mp_ckpt.families.llama_style import dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, shared_expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing, sparse_layers, sparse_step
from mp_ckpt.families.table import (
    Dims,
    Family,
    Rule,
    heads_flat,
    is_linear_attention_layer,
    kv_heads,
)

__all__ = ["ATTENTION_RULES", "DELTA_NET_RULES", "FAMILY", "MTP_RULES", "check_layers", "held",
           "layer_keys", "layer_settings"]  # fmt: skip

_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
_DEFAULTS = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "intermediate_size": 5632,
             "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32}  # fmt: skip
"""transformers' Qwen3NextConfig defaults, for a key config.json omits."""

_LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
           "linear_num_key_heads", "linear_num_value_heads")  # fmt: skip

# --- rules -------------------------------------------------------------------------------


def _ratio(dims: Dims) -> int:
    return dims.linear_value_heads // dims.linear_key_heads


def _qkvz_rows(dims: Dims) -> list[int]:
    dk, vr = dims.linear_key_dim, _ratio(dims) * dims.linear_value_dim
    return [dk, dk, vr, vr]


def _per_key_head(rows):
    """HF's [Hk x rows per key head, h] -> mp's parts [Hk, rows of the part, h]."""

    def to_mp(t, dims: Dims) -> list[torch.Tensor]:
        grouped = t[0].reshape(dims.linear_key_heads, -1, t[0].shape[-1])
        return list(grouped.split(rows(dims), dim=1))

    return to_mp


def _joined(t, dims: Dims) -> list[torch.Tensor]:
    """mp's parts [Hk, rows, h] -> HF's [Hk x rows per key head, h]."""
    return [torch.cat(list(t), dim=1).reshape(-1, t[0].shape[-1])]


def _conv_rows(dims: Dims) -> list[int]:
    return [dims.linear_key_heads * dims.linear_key_dim] * 2 + [
        dims.linear_value_heads * dims.linear_value_dim
    ]


def _conv_to_mp(t, dims: Dims) -> list[torch.Tensor]:
    """HF's [q; k; v channels, 1, K] -> mp's [Hk, channels of a key head, K] each."""
    flat = t[0].reshape(t[0].shape[0], -1)
    return [part.reshape(dims.linear_key_heads, -1, flat.shape[-1])
            for part in flat.split(_conv_rows(dims))]  # fmt: skip


def _conv_to_hf(t, dims: Dims) -> list[torch.Tensor]:
    return [torch.cat([part.reshape(-1, part.shape[-1]) for part in t])[:, None, :]]


def _q_and_gate(t, dims: Dims) -> list[torch.Tensor]:
    """q_proj [H x 2d, h] (per head d query rows, then d gate rows) -> mp's q and gate."""
    heads = t[0].reshape(dims.groups, dims.per_group, 2, dims.head_dim, t[0].shape[-1])
    return [heads[:, :, 0], heads[:, :, 1]]


def _q_proj(t, dims: Dims) -> list[torch.Tensor]:
    return [torch.stack([t[0], t[1]], dim=2).reshape(-1, dims.hidden)]


def _minus_one(t, dims: Dims) -> list[torch.Tensor]:
    return [t[0] - 1]


def _plus_one(t, dims: Dims) -> list[torch.Tensor]:
    return [t[0] + 1]


def _gated(settings: dict) -> bool:
    return bool(settings.get("attention_output_gate"))


_ATTN = "model.layers.{i}.self_attn."
_LIN = "model.layers.{i}.linear_attn."
_QKV = "self_attention.linear_qkv"
_IN = "self_attention.in_proj"
ATTENTION_RULES = (
    Rule((f"{_QKV}.q.weight", f"{_QKV}.gate.weight"), _ATTN + "q_proj.weight", "full_attention",
         to_mp=_q_and_gate, to_hf=_q_proj, megatron=_QKV, when=_gated),
    Rule((f"{_QKV}.k.weight",), _ATTN + "k_proj.weight", "full_attention", to_mp=kv_heads,
         to_hf=heads_flat, megatron=_QKV),
    Rule((f"{_QKV}.v.weight",), _ATTN + "v_proj.weight", "full_attention", to_mp=kv_heads,
         to_hf=heads_flat, megatron=_QKV),
    Rule(("self_attention.linear_proj.weight",), _ATTN + "o_proj.weight", "full_attention"),
    *(Rule((f"self_attention.{p}_layernorm.weight",), f"{_ATTN}{p}_norm.weight",
           "full_attention") for p in "qk"),
)  # fmt: skip
"""Gated softmax attention (Qwen3.5's too)."""
DELTA_NET_RULES = (
    Rule(tuple(f"self_attention.conv1d.{p}.weight" for p in ("query", "key", "value")),
         _LIN + "conv1d.weight", "linear_attention", to_mp=_conv_to_mp, to_hf=_conv_to_hf,
         megatron="self_attention.conv1d"),
    Rule(("self_attention.dt_bias",), _LIN + "dt_bias", "linear_attention"),
    Rule(("self_attention.A_log",), _LIN + "A_log", "linear_attention"),
    Rule(("self_attention.out_norm.weight",), _LIN + "norm.weight", "linear_attention",
         to_mp=_minus_one, to_hf=_plus_one),
    Rule(("self_attention.out_proj.weight",), _LIN + "out_proj.weight", "linear_attention"),
)  # fmt: skip
"""A gated DeltaNet's tensors but its input projections (Qwen3.5's too)."""
MTP_RULES = (
    Rule(("enorm.weight",), "mtp.pre_fc_norm_embedding.weight", "mtp"),
    Rule(("hnorm.weight",), "mtp.pre_fc_norm_hidden.weight", "mtp"),
    Rule(("eh_proj.weight",), "mtp.fc.weight", "mtp"),
    Rule(("final_layernorm.weight",), "mtp.norm.weight", "mtp"),
)  # fmt: skip
RULES = (
    *model_rules(), *norm_rules(), *dense_mlp_rules(), *expert_rules(*_EXPERTS),
    *shared_expert_rules(), *MTP_RULES, *ATTENTION_RULES,
    Rule(tuple(f"{_IN}.{p}.weight" for p in ("query", "key", "value", "z")),
         _LIN + "in_proj_qkvz.weight", "linear_attention", to_mp=_per_key_head(_qkvz_rows),
         to_hf=_joined, megatron=_IN),
    Rule((f"{_IN}.beta.weight", f"{_IN}.alpha.weight"), _LIN + "in_proj_ba.weight",
         "linear_attention", to_mp=_per_key_head(lambda d: [_ratio(d)] * 2), to_hf=_joined,
         megatron=_IN),
    *DELTA_NET_RULES,
)  # fmt: skip

# --- config.json -------------------------------------------------------------------------


def _layer_types(config: dict) -> list[str]:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)]  # fmt: skip
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(
            f"config.json layer_types={types!r}: expected {layers} entries (num_hidden_layers), "
            "each 'linear_attention' or 'full_attention'"
        )
    return list(types)


def _partial_rotary(config: dict) -> float:
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("partial_rotary_factor",
                                config.get("partial_rotary_factor", 0.25)))  # fmt: skip


def layer_settings(config: dict, defaults: dict) -> dict:
    """The settings of Qwen3-Next's layers but their experts (Qwen3.5's too): Llama's with
    the gated DeltaNets where layer_types says, gated attention with zero-centred query and
    key norms, a partial rotation, the multi-token prediction module."""
    refuse(config, "attention_bias", False)
    rope = {k: v for k, v in (config.get("rope_parameters") or {}).items()
            if k != "partial_rotary_factor"}  # fmt: skip
    ffn = positive(config, "intermediate_size", defaults)
    base = llama_settings(config | {"intermediate_size": ffn, "rope_parameters": rope},
                          rope_theta=10000.0, max_positions=32768)  # fmt: skip
    linear = [int(t == "linear_attention") for t in _layer_types(config)]
    mtp = config.get("num_nextn_predict_layers") or 0
    if mtp > 1:
        raise ValueError(
            f"config.json num_nextn_predict_layers={mtp}: Qwen3-Next's layout holds one "
            "multi-token prediction module (one fc and its norms)"
        )
    if mtp and linear[-1]:
        raise ValueError(
            "Qwen3-Next's multi-token prediction layer is gated softmax attention; mp's is "
            "shaped as the model's last layer, here linear_attention"
        )
    return base | {
        "qk_layernorm": True, "apply_layernorm_1p": True, "attention_output_gate": True,
        "rotary_percent": _partial_rotary(config),
        "experimental_attention_variant": "gdn", "linear_attention_freq": linear,
        **{key: positive(config, key, defaults) for key in _LINEAR},
        "mtp_num_layers": mtp or None,
    }  # fmt: skip


def _settings(config: dict) -> dict:
    if config.get("num_experts", _DEFAULTS["num_experts"]) == 0:
        raise ValueError("config.json num_experts=0 (a Qwen3-Next without experts): mp "
                         "converts Qwen3-Next's mixture-of-experts layers")  # fmt: skip
    if config.get("norm_topk_prob", True) not in (True, False):
        raise ValueError(
            f"config.json norm_topk_prob={config['norm_topk_prob']!r}: expected true or false"
        )
    return layer_settings(config, _DEFAULTS) | routing(config, "num_experts", _DEFAULTS) | {
        "moe_ffn_hidden_size": positive(config, "moe_intermediate_size", _DEFAULTS),
        "moe_router_pre_softmax": not config.get("norm_topk_prob", True),
        "moe_shared_expert_intermediate_size": positive(
            config, "shared_expert_intermediate_size", _DEFAULTS),
        "moe_shared_expert_gate": True, "moe_layer_freq": sparse_layers(config),
    }  # fmt: skip


def check_layers(settings: dict, model_type: str) -> None:
    """Refuses settings whose layers are not Qwen3-Next's (nor Qwen3.5's)."""
    for field, value in (("experimental_attention_variant", "gdn"),
                         ("attention_output_gate", True)):  # fmt: skip
        if settings.get(field) != value:
            raise ValueError(f"model_config {field}={settings.get(field)!r}: {model_type} "
                             f"computes only {field}={value!r}")  # fmt: skip


def layer_keys(settings: dict, layers: int, rope_parameters: dict) -> dict:
    """config.json's keys of layer_settings: layer_types, the DeltaNet widths, the partial
    rotation in rope_parameters, num_nextn_predict_layers."""
    partial = settings.get("rotary_percent", 1.0)
    types = ["linear_attention" if is_linear_attention_layer(settings, i) else "full_attention"
             for i in range(layers)]  # fmt: skip
    return {
        "rope_parameters": {**rope_parameters, "partial_rotary_factor": partial},
        "attention_bias": False, "layer_types": types,
        **{key: settings.get(key, _DEFAULTS[key]) for key in _LINEAR},
    } | _mtp_keys(settings)  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    check_layers(settings, "qwen3_next")
    if settings.get("moe_shared_expert_gate") is not True:
        raise ValueError(f"model_config moe_shared_expert_gate="
                         f"{settings.get('moe_shared_expert_gate')!r}: qwen3_next computes "
                         "only moe_shared_expert_gate=True")  # fmt: skip
    config = moe_config(settings, shapes, tokens, dtype, "qwen3_next", None, qk_layernorm=True,
                        apply_layernorm_1p=True,
                        rotary_percent=settings.get("rotary_percent", 1.0))  # fmt: skip
    step, dense = sparse_step(shapes["sparse"])
    return config | layer_keys(settings, shapes["layers"], config["rope_parameters"]) | {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "intermediate_size": shapes.get("ffn") or settings.get("ffn_hidden_size"),
        "moe_intermediate_size": shapes["expert_ffn"],
        "shared_expert_intermediate_size": shapes["shared_ffn"],
        "num_experts": shapes["experts"], "decoder_sparse_step": step, "mlp_only_layers": dense,
        "norm_topk_prob": not settings.get("moe_router_pre_softmax", False),
    }  # fmt: skip


def _mtp_keys(settings: dict) -> dict:
    """num_nextn_predict_layers where the model has a module (vLLM's key; no key without)."""
    mtp = settings.get("mtp_num_layers") or 0
    if mtp > 1 or (mtp and settings.get("mtp_use_repeated_layer")):
        raise ValueError(f"model_config mtp_num_layers={mtp}: Qwen3-Next's layout holds one "
                         "multi-token prediction module")  # fmt: skip
    return {"num_nextn_predict_layers": mtp} if mtp else {}


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def held(config: dict, names) -> dict:
    """config.json with num_nextn_predict_layers as the weights hold modules (transformers'
    Qwen3-Next config has no such key; a module's tensors are mtp.*)."""
    modules = {int(m.group(1)) for name in names if (m := _MTP_LAYER.match(name))}
    held = len(modules) or int(any(name.startswith("mtp.") for name in names))
    return config | {"num_nextn_predict_layers": held}


FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*_EXPERTS), held=held,
                mtp_sublayer=("model.layers.{i}.", "mtp.layers.{i}."))  # fmt: skip
