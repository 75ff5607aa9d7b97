"""Every tensor mp's GPTModel can have, under mp's and Megatron-LM's names: the table a
Megatron conversion falls back on for a tensor the settings' family does not name. A
Megatron checkpoint says no family, and its settings may mix the families' features
(biases on a Llama-style model, LayerNorm with rotary embeddings, ...). There is no
Hugging Face side: `hf` is empty.

mp (decoder.layers.{i}.)                       Megatron-LM, where it differs
    input_layernorm.{weight,bias}
    self_attention.linear_qkv.{q,k,v}.{weight,bias}  self_attention.linear_qkv.*, fused
    self_attention.linear_qkv.gate.{weight,bias}     (attention_output_gate)
    self_attention.in_proj.{query,key,value,z,beta,alpha}.weight   a gated DeltaNet's:
    self_attention.conv1d.{query,key,value}.weight     in_proj.*, conv1d.*, fused
    self_attention.{dt_bias,A_log,out_norm.weight,out_proj.weight}
    self_attention.linear_proj.{weight,bias}
    self_attention.{q,k}_layernorm.{weight,bias}
    self_attention.linear_q_proj.weight, or linear_q_down_proj.weight and
        linear_q_up_proj.weight                (multi-latent attention: mp's names are
    self_attention.linear_kv_down_proj.weight   Megatron's local spec's; its TE spec's
    self_attention.linear_kv_up_proj.weight     names are aliases: megatron_view.py)
    self_attention.kv_layernorm.{weight,bias}
    self_attention.core_attention.indexer.{linear_wq_b.weight, linear_wk.weight,
        k_norm.{weight,bias}, linear_weights_proj.weight}   (DeepSeek's sparse attention's
                                               indexer, whole on every TP rank)
    self_attention.core_attention.softmax_offset
    pre_mlp_layernorm.{weight,bias}
    mlp.linear_fc1.{gate,up}.{weight,bias}     mlp.linear_fc1.*, fused (gated MLP)
    mlp.linear_fc1.{weight,bias}               (other MLPs)
    mlp.linear_fc2.{weight,bias}
    mlp.router.{weight,bias,expert_bias,qb_beta}
    mlp.experts.linear_fc1[.{gate,up}].{weight,bias}   mlp.experts.experts.linear_fc1.*
    mlp.experts.linear_fc2.{weight,bias}       mlp.experts.experts.linear_fc2.*
    mlp.shared_experts.linear_fc1[.{gate,up}].{weight,bias}, .linear_fc2.{weight,bias},
        .gate_weight
and embedding.word_embeddings.weight, embedding.position_embeddings.weight,
decoder.final_layernorm.{weight,bias}, output_layer.weight; each multi-token prediction
module's (mtp.layers.{k}.) enorm, hnorm, eh_proj, final_layernorm and, under
transformer_layer., a layer's tensors (Megatron's names too).

`when` marks only the tensors that exclude one another (a gated fc1's gate and up, or a
plain fc1): which of the others a model has, its tensors say.
"""

from __future__ import annotations

from mp_ckpt.families.table import Rule

__all__ = ["RULES", "gated"]

_QKV = "self_attention.linear_qkv"
# multi-latent attention's projections (multi_latent_attention.py in mp-layers)
_MLA = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
        "linear_kv_up_proj")  # fmt: skip
_PARTS = ("weight", "bias")
# DeepSeek's sparse attention's indexer (mp_layers' and Megatron's names alike)
_INDEXER = "self_attention.core_attention.indexer."
_INDEXER_TENSORS = ("linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias",
                    "linear_weights_proj.weight")  # fmt: skip
# a gated DeltaNet's in_proj parts (conv1d's: the first three)
_GDN_IN = ("query", "key", "value", "z", "beta", "alpha")


def gated(settings: dict) -> bool:
    """Whether the settings' MLPs are gated: fc1 holds a gate and an up projection (swiglu,
    or gpt-oss's quick GEGLU)."""
    return settings.get("activation") in ("swiglu", "geglu") or bool(settings.get("quick_geglu"))


def _plain(settings: dict) -> bool:
    return not gated(settings)


def _output_gate(settings: dict) -> bool:
    return bool(settings.get("attention_output_gate"))


def _same(names, scope) -> tuple[Rule, ...]:
    return tuple(Rule((name,), (), scope) for name in names)


def _fc1(ours: str, megatron: str | None, scope) -> tuple[Rule, ...]:
    """fc1's gate and up when the MLP is gated, else fc1 itself."""
    glu = tuple(Rule((f"{ours}.{p}.{part}",), (), scope, when=gated, megatron=megatron or ours)
                for p in ("gate", "up") for part in _PARTS)  # fmt: skip
    plain = tuple(Rule((f"{ours}.{part}",), (), scope, when=_plain, megatron=megatron)
                  for part in _PARTS)  # fmt: skip
    return glu + plain


def _both(*modules: str) -> list[str]:
    return [f"{module}.{part}" for module in modules for part in _PARTS]


RULES = (
    *_same(["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            *_both("decoder.final_layernorm"), "output_layer.weight"], "model"),
    *_same(_both("input_layernorm"), "layer"),
    *(Rule((f"{_QKV}.{p}.{part}",), (), megatron=_QKV) for p in "qkv" for part in _PARTS),
    *(Rule((f"{_QKV}.gate.{part}",), (), megatron=_QKV, when=_output_gate) for part in _PARTS),
    *(Rule((f"self_attention.in_proj.{p}.weight",), (), "linear_attention",
           megatron="self_attention.in_proj") for p in _GDN_IN),
    *(Rule((f"self_attention.conv1d.{p}.weight",), (), "linear_attention",
           megatron="self_attention.conv1d") for p in _GDN_IN[:3]),
    *_same(["self_attention.dt_bias", "self_attention.A_log", "self_attention.out_norm.weight",
            "self_attention.out_proj.weight"], "linear_attention"),
    *_same([*_both("self_attention.linear_proj", "self_attention.q_layernorm",
                   "self_attention.k_layernorm"),
            "self_attention.core_attention.softmax_offset", *_both("pre_mlp_layernorm")],
           "layer"),
    *_same([*(f"self_attention.{m}.weight" for m in _MLA),
            *_both("self_attention.kv_layernorm")], "layer"),
    *_same([_INDEXER + name for name in _INDEXER_TENSORS], "layer"),
    *_fc1("mlp.linear_fc1", None, "dense"),
    *_same(_both("mlp.linear_fc2"), "dense"),
    *_same([*_both("mlp.router"), "mlp.router.expert_bias", "mlp.router.qb_beta"], "moe"),
    *_fc1("mlp.experts.linear_fc1", "mlp.experts.experts.linear_fc1", "moe"),
    *(Rule((name,), (), "moe", megatron="mlp.experts.experts.linear_fc2")
      for name in _both("mlp.experts.linear_fc2")),
    *_fc1("mlp.shared_experts.linear_fc1", None, "moe"),
    *_same([*_both("mlp.shared_experts.linear_fc2"), "mlp.shared_experts.gate_weight"], "moe"),
    *_same([*_both("enorm", "hnorm", "final_layernorm"), "eh_proj.weight"], "mtp"),
)  # fmt: skip
