"""FlexOlmo (model_type "flex_olmo", FlexOlmoForCausalLM): OLMo 2's layers (each sublayer's
output normalized, queries and keys over all heads: olmo2.py) with OLMoE's experts in
every MLP (softmax routing, the top k renormalized only with norm_topk_prob: olmoe.py).

Refused besides OLMo 2's and OLMoE's: nothing more (FlexOlmo has no clip_qkv).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import head_dim_where_it_differs
from mp_ckpt.families.llama_style import attention_rules, model_rules
from mp_ckpt.families.moe import expert_rules, unfuse_experts
from mp_ckpt.families.olmo2 import OLMO2_NORMS, output_norm_rules
from mp_ckpt.families.olmoe import EXPERTS, expert_config, expert_layers
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_DEFAULTS = {"num_experts": 7, "num_experts_per_tok": 5, "intermediate_size": 11008}
"""FlexOlmoConfig's defaults, for a key config.json omits."""
RULES = (*model_rules(), *attention_rules(qk_norm=True), *output_norm_rules(),
         *expert_rules(*EXPERTS))  # fmt: skip


def _settings(config: dict) -> dict:
    return expert_layers(config, _DEFAULTS, rms_norm_eps=1e-6, rope_theta=500000.0) | OLMO2_NORMS


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = expert_config(settings, shapes, tokens, dtype, "flex_olmo", OLMO2_NORMS)
    return head_dim_where_it_differs(config, shapes) | {"architectures": ["FlexOlmoForCausalLM"]}


FAMILY = Family("flex_olmo", "FlexOlmoForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS))  # fmt: skip
