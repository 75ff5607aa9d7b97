"""Granite 3.0 MoE (model_type "granitemoe", GraniteMoeForCausalLM: granite-3.0-1b-a400m,
granite-3.0-3b-a800m): Granite's layers and four scales (granite.py) with every MLP a
mixture of num_local_experts experts of intermediate_size: the top num_experts_per_tok by
router logit, weighted by a softmax over those (Mixtral's routing:
moe_router_pre_softmax False), trained with the Switch load-balancing loss
(router_aux_loss_coef). granitemoeshared.py adds a shared MLP beside the experts, and
granitemoehybrid.py Mamba layers; both save their experts as these do:

Hugging Face (model.layers.{i}.)                     mp (decoder.layers.{i}.)
    block_sparse_moe.router.layer.weight [E, h]         mlp.router.weight
    block_sparse_moe.input_linear.weight [E, 2F, h]     mlp.experts.linear_fc1.{gate,up}.weight
                                                        [E, F, h] (each expert's gate rows
                                                        first)
    block_sparse_moe.output_linear.weight [E, h, F]     mlp.experts.linear_fc2.weight
    shared_mlp.input_linear.weight [2S, h]              mlp.shared_experts.linear_fc1.{gate,up}
                                                        .weight [S, h] (granitemoeshared)
    shared_mlp.output_linear.weight [h, S]              mlp.shared_experts.linear_fc2.weight

transformers' in-memory names (block_sparse_moe.experts.gate_up_proj, .down_proj and
router.weight) are read as the saved ones. Attention and norms as Llama's
(llama_style.py). Refused besides Llama's: attention_bias.
"""

from __future__ import annotations

import re

from mp_ckpt.families.granite import scale_keys, scale_settings
from mp_ckpt.families.hf_settings import head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama_style import (
    attention_rules,
    join_gate_up,
    model_rules,
    norm_rules,
    split_gate_up,
)
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.table import Family, Rule, Scope

__all__ = ["FAMILY", "expert_rules", "granite_moe_config", "in_memory_names",
           "shared_mlp_rules"]  # fmt: skip

_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 11008}
"""transformers' GraniteMoeConfig defaults, for a key config.json omits."""

_LAYER = "model.layers.{i}."


def expert_rules(scope: Scope = "moe") -> tuple[Rule, ...]:
    """The router and the stacked experts of block_sparse_moe."""
    block = _LAYER + "block_sparse_moe."
    return (
        Rule(("mlp.router.weight",), block + "router.layer.weight", scope),
        Rule(("mlp.experts.linear_fc1.gate.weight", "mlp.experts.linear_fc1.up.weight"),
             block + "input_linear.weight", scope, to_mp=split_gate_up, to_hf=join_gate_up,
             megatron="mlp.experts.experts.linear_fc1"),
        Rule(("mlp.experts.linear_fc2.weight",), block + "output_linear.weight", scope,
             megatron="mlp.experts.experts.linear_fc2"),
    )  # fmt: skip


def shared_mlp_rules(module: str, scope: Scope, when=None) -> tuple[Rule, ...]:
    """shared_mlp as mp's `module` ("mlp.shared_experts" beside experts, "mlp" as a
    dense MLP of its own)."""
    shared = _LAYER + "shared_mlp."
    return (
        Rule((f"{module}.linear_fc1.gate.weight", f"{module}.linear_fc1.up.weight"),
             shared + "input_linear.weight", scope, to_mp=split_gate_up, to_hf=join_gate_up,
             when=when, megatron=f"{module}.linear_fc1"),
        Rule((f"{module}.linear_fc2.weight",), shared + "output_linear.weight", scope,
             when=when),
    )  # fmt: skip


RULES = (*model_rules(), *attention_rules(), *norm_rules(), *expert_rules())

_IN_MEMORY = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.)(experts\.gate_up_proj|experts\.down_proj|"
    r"router\.weight)$"
)
_SAVED = {
    "experts.gate_up_proj": "input_linear.weight",
    "experts.down_proj": "output_linear.weight",
    "router.weight": "router.layer.weight",
}


def in_memory_names(state: dict, config: dict) -> dict:
    """A `prepare` hook: transformers' in-memory expert names -> the saved ones."""
    out = {}
    for name, tensor in state.items():
        match = _IN_MEMORY.match(name)
        out[match.group(1) + _SAVED[match.group(2)] if match else name] = tensor
    return out


def expert_settings(config: dict) -> dict:
    """The experts' settings: num_local_experts of intermediate_size, Mixtral's routing."""
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    return routing(config, "num_local_experts", _DEFAULTS) | {
        "moe_ffn_hidden_size": ffn, "moe_router_pre_softmax": False, "moe_layer_freq": [1],
    }  # fmt: skip


def _settings(config: dict) -> dict:
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    base = llama_settings(config | {"intermediate_size": ffn}, rms_norm_eps=1e-6,
                          max_positions=2048)  # fmt: skip
    return base | scale_settings(config) | expert_settings(config) | {
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    }  # fmt: skip


def granite_moe_config(settings: dict, shapes: dict, tokens: dict, dtype: str,
                       model_type: str) -> dict:  # fmt: skip
    """The config.json of Granite's MoE models: Mixtral's keys with Granite's scales."""
    computes, keys = scale_keys(settings)
    config = moe_config(settings, shapes, tokens, dtype, model_type, False, **computes)
    config = head_dim_where_it_differs(config, shapes)  # GraniteMoeConfig has none
    return config | keys | {
        "intermediate_size": shapes["expert_ffn"], "num_local_experts": shapes["experts"],
        "attention_bias": False,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if settings.get("moe_shared_expert_intermediate_size"):
        raise ValueError("the granitemoe export has no shared expert: its model is "
                         "granitemoeshared")  # fmt: skip
    return granite_moe_config(settings, shapes, tokens, dtype, "granitemoe") | {
        "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe"}  # fmt: skip


FAMILY = Family("granitemoe", "GraniteMoeForCausalLM", RULES, _settings, _config,
                prepare=in_memory_names)  # fmt: skip
