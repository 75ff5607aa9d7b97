"""GPT-2 (model_type "gpt2", GPT2LMHeadModel): learned positions, LayerNorm, biases,
gelu; the output layer tied to the embedding.

GPT-2's Conv1D weights are [in, out]: transposed on the way. Its c_attn holds q, k and
v side by side ([h, 3h]); mp keeps them per head ([heads, 1, d, h] and [heads, d, h]).
A GPT2Model state dict (no "transformer." prefix) imports too.
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import LLAMA_STYLE, check_computes, refuse, token_ids
from mp_ckpt.families.table import Dims, Family, Rule, transposed

__all__ = ["FAMILY"]

# GPT-2's activation_function -> openai_gelu (activation is "gelu" for each).
_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
_QKV = tuple(f"self_attention.linear_qkv.{p}.{w}" for w in ("weight", "bias") for p in "qkv")
_LAYER = "transformer.h.{i}."
_COMPUTES = LLAMA_STYLE | {"normalization": "LayerNorm", "activation": "gelu",
                           "position_embedding_type": "learned_absolute"}  # fmt: skip


def _qkv_to_mp(t, dims: Dims) -> list[torch.Tensor]:
    h, d = dims.hidden, dims.head_dim
    weight, bias = t[0].t(), t[1]
    shapes = {"q": (dims.heads, 1, d), "k": (dims.heads, d), "v": (dims.heads, d)}
    weights = [w.reshape(*shapes[p], h) for p, w in zip("qkv", weight.chunk(3), strict=True)]
    biases = [b.reshape(shapes[p]) for p, b in zip("qkv", bias.chunk(3), strict=True)]
    return [*weights, *biases]


def _qkv_to_hf(t, dims: Dims) -> list[torch.Tensor]:
    h = dims.hidden
    weight = torch.cat([w.reshape(-1, h) for w in t[:3]]).t().contiguous()
    return [weight, torch.cat([b.reshape(-1) for b in t[3:]])]


_RULES = (
    Rule(("embedding.word_embeddings.weight",), "transformer.wte.weight", "model"),
    Rule(("embedding.position_embeddings.weight",), "transformer.wpe.weight", "model"),
    Rule(("decoder.final_layernorm.weight",), "transformer.ln_f.weight", "model"),
    Rule(("decoder.final_layernorm.bias",), "transformer.ln_f.bias", "model"),
    Rule(_QKV, (_LAYER + "attn.c_attn.weight", _LAYER + "attn.c_attn.bias"),
         to_mp=_qkv_to_mp, to_hf=_qkv_to_hf, megatron="self_attention.linear_qkv"),
    *(
        rule
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"),
                             ("mlp.linear_fc1", "mlp.c_fc"), ("mlp.linear_fc2", "mlp.c_proj"))
        for rule in (
            Rule((f"{ours}.weight",), f"{_LAYER}{theirs}.weight", to_mp=transposed,
                 to_hf=transposed),
            Rule((f"{ours}.bias",), f"{_LAYER}{theirs}.bias"),
        )
    ),
    *(
        Rule((f"{ours}.{part}",), f"{_LAYER}{theirs}.{part}")
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
        for part in ("weight", "bias")
    ),
)  # fmt: skip


def _prepare(state: dict, config: dict) -> dict:
    """GPT2Model's names (no "transformer." prefix) -> GPT2LMHeadModel's."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
            for k, v in state.items()}  # fmt: skip


def _settings(config: dict) -> dict:
    h = config["n_embd"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"config.json activation_function={activation!r}: mp computes "
            f"{', '.join(_ACTIVATIONS)} for GPT-2"
        )
    refuse(config, "scale_attn_weights", True)
    refuse(config, "scale_attn_by_inverse_layer_idx", False)
    return {
        "num_layers": config["n_layer"], "hidden_size": h,
        "num_attention_heads": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * h,
        "normalization": "LayerNorm", "activation": "gelu",
        "openai_gelu": _ACTIVATIONS[activation],
        "position_embedding_type": "learned_absolute",
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "add_bias_linear": True, "untie_embeddings_and_output_weights": False,
        "hidden_dropout": config.get("resid_pdrop", 0.1),
        "attention_dropout": config.get("attn_pdrop", 0.1),
        "init_method_std": config.get("initializer_range", 0.02),
        "vocab_size": config["vocab_size"], "max_position_embeddings": config["n_positions"],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    """GPT2LMHeadModel's config.json."""
    h = shapes["hidden"]
    hidden_dropout = settings.get("hidden_dropout", 0.0)
    check_computes(settings, "gpt2", _COMPUTES)
    if not shapes["tied"]:
        raise ValueError(
            "GPT2LMHeadModel ties its output layer to the embedding; this checkpoint has a "
            "separate output_layer.weight: export it as llama"
        )
    if shapes["groups"] != shapes["heads"]:
        raise ValueError(
            f"grouped-query attention ({shapes['heads'] // shapes['groups']} query heads per "
            "group); GPT-2 has one key/value head per query head: export it as llama"
        )
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": shapes["vocab"], "n_positions": shapes["positions"], "n_embd": h,
        "n_layer": shapes["layers"], "n_head": shapes["heads"],
        "n_inner": None if shapes["ffn"] == 4 * h else shapes["ffn"],
        "activation_function": "gelu_new" if settings.get("openai_gelu") else "gelu",
        "layer_norm_epsilon": settings.get("layernorm_epsilon", 1e-5),
        "resid_pdrop": hidden_dropout, "embd_pdrop": hidden_dropout,
        "attn_pdrop": settings.get("attention_dropout", 0.0),
        "initializer_range": settings.get("init_method_std", 0.02),
        "tie_word_embeddings": True, **token_ids(tokens), "torch_dtype": dtype,
    }  # fmt: skip


FAMILY = Family("gpt2", "GPT2LMHeadModel", _RULES, _settings, _config, prepare=_prepare)
