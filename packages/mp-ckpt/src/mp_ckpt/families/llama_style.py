"""The rules every Llama-style family shares: embeddings, attention, norms, a gated MLP.

Hugging Face (model.layers.{i}.)      mp (decoder.layers.{i}.)
    self_attn.{q,k,v}_proj.weight      self_attention.linear_qkv.{q,k,v}.weight
        q [heads x d, h] <-> [groups, heads per group, d, h]; k, v [groups x d, h] <->
        [groups, d, h]. Both orders group the query heads of a key/value head together
        and rotate channel pairs (i, i + d/2) (Llama 4: both (2i, 2i + 1), with
        rotary_interleaved), so the reshape is the whole transform.
    self_attn.{q,k,v}_proj.bias        ....{q,k,v}.bias (Qwen2, gpt-oss)
    self_attn.o_proj.weight / .bias    self_attention.linear_proj.weight / .bias
    self_attn.{q,k}_norm.weight        self_attention.{q,k}_layernorm.weight (Qwen3)
    input_layernorm.weight             input_layernorm.weight
    post_attention_layernorm.weight    pre_mlp_layernorm.weight
    mlp.{gate,up,down}_proj.weight     mlp.linear_fc1.{gate,up}.weight, mlp.linear_fc2.weight
model.embed_tokens.weight, model.norm.weight and lm_head.weight (untied only) are
embedding.word_embeddings.weight, decoder.final_layernorm.weight and output_layer.weight.
"""

from __future__ import annotations

import torch

from mp_ckpt.families.table import Rule, flat, heads_flat, kv_heads, q_heads

__all__ = ["attention_rules", "dense_mlp_rules", "fused_mlp_rules", "join_gate_up", "model_rules",
           "norm_rules", "split_gate_up"]  # fmt: skip

_QKV = "self_attention.linear_qkv"


def _has(field: str):
    return lambda settings: bool(settings.get(field))


def model_rules(*, norm_bias: bool = False) -> tuple[Rule, ...]:
    rules = [
        Rule(("embedding.word_embeddings.weight",), "model.embed_tokens.weight", "model"),
        Rule(("decoder.final_layernorm.weight",), "model.norm.weight", "model"),
        Rule(("output_layer.weight",), "lm_head.weight", "model",
             when=_has("untie_embeddings_and_output_weights")),
    ]  # fmt: skip
    if norm_bias:
        rules.append(Rule(("decoder.final_layernorm.bias",), "model.norm.bias", "model"))
    return tuple(rules)


def attention_rules(*, qkv_bias: bool | None = False, proj_bias: bool = False,
                    qk_norm: bool | None = False) -> tuple[Rule, ...]:  # fmt: skip
    """qkv_bias: True always, None where the settings' add_qkv_bias says so; qk_norm the
    same, by qk_layernorm."""
    layer = "model.layers.{i}.self_attn."
    rules = [
        Rule((f"{_QKV}.q.weight",), layer + "q_proj.weight", to_mp=q_heads, to_hf=heads_flat,
             megatron=_QKV),
        Rule((f"{_QKV}.k.weight",), layer + "k_proj.weight", to_mp=kv_heads, to_hf=heads_flat,
             megatron=_QKV),
        Rule((f"{_QKV}.v.weight",), layer + "v_proj.weight", to_mp=kv_heads, to_hf=heads_flat,
             megatron=_QKV),
        Rule(("self_attention.linear_proj.weight",), layer + "o_proj.weight"),
    ]  # fmt: skip
    if qkv_bias is not False:
        when = None if qkv_bias else _has("add_qkv_bias")
        rules += [
            Rule((f"{_QKV}.{p}.bias",), f"{layer}{p}_proj.bias", when=when, megatron=_QKV,
                 to_mp=q_heads if p == "q" else kv_heads, to_hf=flat)
            for p in "qkv"
        ]  # fmt: skip
    if proj_bias:
        rules.append(Rule(("self_attention.linear_proj.bias",), layer + "o_proj.bias"))
    if qk_norm is not False:
        when = None if qk_norm else _has("qk_layernorm")
        rules += [
            Rule((f"self_attention.{p}_layernorm.weight",), f"{layer}{p}_norm.weight", when=when)
            for p in "qk"
        ]
    return tuple(rules)


def norm_rules(*, bias: bool = False) -> tuple[Rule, ...]:
    layer = "model.layers.{i}."
    parts = ("weight", "bias") if bias else ("weight",)
    return tuple(
        Rule((f"{ours}.{part}",), f"{layer}{theirs}.{part}")
        for ours, theirs in (("input_layernorm", "input_layernorm"),
                             ("pre_mlp_layernorm", "post_attention_layernorm"))
        for part in parts
    )  # fmt: skip


def split_gate_up(t, dims) -> list:
    """A fused gate/up weight [..., 2F, h] (the F gate rows, then the F up rows; stacked
    experts [E, 2F, h] too) -> the gate's and the up's."""
    return [part.contiguous() for part in t[0].chunk(2, dim=-2)]


def join_gate_up(t, dims) -> list:
    return [torch.cat(list(t), dim=-2)]


def fused_mlp_rules() -> tuple[Rule, ...]:
    """A gated MLP whose gate and up projections are one tensor, mlp.gate_up_proj.weight
    [2F, h] (the gate's F rows, then the up's: Phi-3's, GLM-4's), and mlp.down_proj."""
    layer = "model.layers.{i}.mlp."
    return (
        Rule(("mlp.linear_fc1.gate.weight", "mlp.linear_fc1.up.weight"),
             layer + "gate_up_proj.weight", "dense", to_mp=split_gate_up, to_hf=join_gate_up,
             megatron="mlp.linear_fc1"),
        Rule(("mlp.linear_fc2.weight",), layer + "down_proj.weight", "dense"),
    )  # fmt: skip


def dense_mlp_rules(*, gated: bool = True, block: str = "mlp") -> tuple[Rule, ...]:
    """block: the MLP's module under model.layers.{i} (Llama 4's "feed_forward")."""
    layer = f"model.layers.{{i}}.{block}."
    down = Rule(("mlp.linear_fc2.weight",), layer + "down_proj.weight", "dense")
    if not gated:
        return (Rule(("mlp.linear_fc1.weight",), layer + "up_proj.weight", "dense"), down)
    return (
        Rule(("mlp.linear_fc1.gate.weight",), layer + "gate_proj.weight", "dense",
             megatron="mlp.linear_fc1"),
        Rule(("mlp.linear_fc1.up.weight",), layer + "up_proj.weight", "dense",
             megatron="mlp.linear_fc1"),
        down,
    )  # fmt: skip
