"""Llama 2 / 3.x (model_type "llama", LlamaForCausalLM): RMSNorm, gated silu, RoPE
(with Llama 3.1's "llama3" or linear scaling), grouped-query attention, no biases;
tied or untied output layer. The parameter names are llama_style's."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import llama_config, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.table import Family

__all__ = ["FAMILY", "RULES"]

RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules())

FAMILY = Family("llama", "LlamaForCausalLM", RULES, llama_settings, llama_config)
