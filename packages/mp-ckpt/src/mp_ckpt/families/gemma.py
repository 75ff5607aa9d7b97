"""Gemma (model_type "gemma", GemmaForCausalLM: Gemma 2B and 7B, CodeGemma): Llama's
tensors in pre-norm layers with Gemma's choices, each an mp setting (Gemma 3's without
its sandwich norms, query/key norms, windows and score scalar: gemma3_text.py):

    zero-centred RMSNorm weights, x (1 + w)             apply_layernorm_1p
    gated GELU (tanh approximation)                     activation "geglu", openai_gelu
    the embeddings times sqrt(hidden_size)              scale_word_embeddings
    heads of head_dim (256), scores scaled by its       kv_channels
      inverse square root; multi-query attention
      (2B: one key/value head)

hidden_act "gelu", the released configs' value, is read as transformers reads it: the tanh
approximation (written back as gelu_pytorch_tanh). Refused besides Llama's: another
activation, bidirectional attention (use_bidirectional_attention).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_GEMMA = {"activation": "geglu", "openai_gelu": True, "apply_layernorm_1p": True,
          "scale_word_embeddings": True}  # fmt: skip
_TANH = ("gelu_pytorch_tanh", "gelu")
"""hidden_act values transformers computes as the tanh-approximated GELU."""

RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules())


def _settings(config: dict) -> dict:
    act = config.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _TANH:
        raise ValueError(f"config.json hidden_act={act!r}: mp computes Gemma's gated GELU in "
                         "the tanh approximation (gelu_pytorch_tanh, or its older name "
                         "gelu)")  # fmt: skip
    if config.get("use_bidirectional_attention"):  # None and false: causal
        refuse(config, "use_bidirectional_attention", False)
    config = {k: v for k, v in config.items() if k != "hidden_act"}
    base = llama_settings(config, rms_norm_eps=1e-6, max_positions=8192)
    return base | _GEMMA | {
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "gemma", **_GEMMA)
    return config | {
        "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
        "hidden_act": "gelu_pytorch_tanh", "attention_bias": False,
        "use_bidirectional_attention": None,
    }  # fmt: skip


FAMILY = Family("gemma", "GemmaForCausalLM", RULES, _settings, _config)
