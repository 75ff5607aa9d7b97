"""OLMo 2 (model_type "olmo2", Olmo2ForCausalLM): Llama's attention and gated MLP with
two differences, both mp settings of their own:

- each sublayer's output is normalized before the residual add, and its input is not
  (sublayer_norm "output"): post_attention_layernorm and post_feedforward_layernorm,
  mp's post_self_attn_layernorm and post_mlp_layernorm;
- the queries and keys are normalized over all heads together, before the heads are
  split (qk_layernorm with qk_layernorm_scope "all_heads"): q_norm [heads x head_dim],
  k_norm [key heads x head_dim], mp's q_layernorm and k_layernorm of those shapes.

Hugging Face (model.layers.{i}.)        mp (decoder.layers.{i}.)
    self_attn.{q,k,v,o}_proj, mlp.*     as Llama's (llama_style.py)
    self_attn.{q,k}_norm.weight         self_attention.{q,k}_layernorm.weight
    post_attention_layernorm.weight     post_self_attn_layernorm.weight
    post_feedforward_layernorm.weight   post_mlp_layernorm.weight

Refused besides Llama's: attention_bias (the released models have none).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY", "OLMO2_NORMS", "output_norm_rules"]

OLMO2_NORMS = {"qk_layernorm": True, "qk_layernorm_scope": "all_heads",
               "sublayer_norm": "output"}  # fmt: skip
"""The settings OLMo 2's norms are (OLMo 3's too)."""


def output_norm_rules() -> tuple[Rule, ...]:
    layer = "model.layers.{i}."
    return (
        Rule(("post_self_attn_layernorm.weight",), layer + "post_attention_layernorm.weight"),
        Rule(("post_mlp_layernorm.weight",), layer + "post_feedforward_layernorm.weight"),
    )


RULES = (*model_rules(), *attention_rules(qk_norm=True), *output_norm_rules(),
         *dense_mlp_rules())  # fmt: skip


def _settings(config: dict) -> dict:
    base = llama_settings(config, rope_theta=10000.0, rms_norm_eps=1e-5, max_positions=2048)
    return base | OLMO2_NORMS


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = base_config(settings, shapes, tokens, dtype, "olmo2", **OLMO2_NORMS)
    return head_dim_where_it_differs(config, shapes) | {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "attention_bias": False,
    }  # fmt: skip


FAMILY = Family("olmo2", "Olmo2ForCausalLM", RULES, _settings, _config)
