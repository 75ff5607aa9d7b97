"""Granite 4 (model_type "granitemoehybrid", GraniteMoeHybridForCausalLM: granite-4.0-h-small,
-h-tiny, -h-micro, and the attention-only granite-4.0-micro): each Hugging Face layer a
mixer, a Mamba-2 mixer or self-attention, then an MLP, each behind its own RMSNorm, with
Granite's four scales (granite.py). mp builds it as a hybrid model of two layers for each,
the mixer's then the MLP's (hybrid_layer_pattern, Hugging Face layer j being mp's layers
2j and 2j + 1):

    layer_types "mamba" ("linear_attention")     M   a Mamba-2 mixer
    layer_types "attention" ("full_attention")   *   self-attention
    num_local_experts > 0                        E   experts beside the shared MLP (mp's
                                                     shared expert, ungated)
    num_local_experts 0                          -   the shared MLP alone

Hugging Face (model.layers.{j}.)                mp
    input_layernorm.weight                         layer 2j's norm.weight (M) or
                                                   input_layernorm.weight (*)
    mamba.*                                        layer 2j's mixer.* (mamba_rules.py)
    self_attn.{q,k,v,o}_proj.weight                layer 2j's self_attention.* (Llama's)
    post_attention_layernorm.weight                layer 2j + 1's pre_mlp_layernorm.weight
    block_sparse_moe.*, shared_mlp.*               layer 2j + 1's mlp.* (granitemoe.py)

config.json -> settings: layer_types (or layers_block_type; absent: every layer Mamba) ->
hybrid_layer_pattern; position_embedding_type "rope" -> rope (rope_parameters), null or
"nope" -> none (Granite 4.0-H: no positional embeddings; its rope_parameters kept to be
written back); the Mamba mixers' keys as Bamba's (mamba_rules.py); rms_norm_eps (the
mixers' gated norms' too) -> layernorm_epsilon; the experts as granitemoe's,
shared_intermediate_size S the shared MLP's width (ffn_hidden_size), intermediate_size
the experts'. A model without experts writes intermediate_size S and transformers'
defaults for the routing keys it does not use; position_embedding_type "nope" is written
as null (transformers reads both alike).

Refused (with the key and value): hidden_act other than silu (the MLPs' and the mixers'),
attention_bias true, shared_intermediate_size 0 (transformers' layers always add the
shared MLP), and the Mamba keys mamba_rules.py refuses.
"""

from __future__ import annotations

from mp_ckpt.families.granite import scale_keys, scale_settings
from mp_ckpt.families.granitemoe import (
    expert_rules,
    expert_settings,
    in_memory_names,
    shared_mlp_rules,
)
from mp_ckpt.families.granitemoeshared import shared_width
from mp_ckpt.families.hf_settings import (
    base_config,
    head_dim_where_it_differs,
    llama_settings,
)
from mp_ckpt.families.llama_style import model_rules
from mp_ckpt.families.mamba_rules import mamba_config, mamba_settings
from mp_ckpt.families.mixer_pairs import mixer_rules, mixers, pair_layer
from mp_ckpt.families.moe_settings import aux_loss_coef, check_routing
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY"]

_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
"""transformers' GraniteMoeHybridConfig defaults, for a key config.json omits."""

_SYMBOLS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention"}

_L = "model.layers.{i}."
RULES = (
    *model_rules(),
    *mixer_rules(_L),
    Rule(("pre_mlp_layernorm.weight",), _L + "post_attention_layernorm.weight", "dense"),
    *shared_mlp_rules("mlp", "dense"),
    Rule(("pre_mlp_layernorm.weight",), _L + "post_attention_layernorm.weight", "moe"),
    *expert_rules("moe"),
    *shared_mlp_rules("mlp.shared_experts", "moe"),
)  # fmt: skip


# --- config.json -> settings -------------------------------------------------------------


def _pattern(config: dict, experts: bool) -> str:
    kinds = config.get("layer_types") or config.get("layers_block_type")
    if kinds is None:
        kinds = ["linear_attention"] * config["num_hidden_layers"]
    unknown = sorted({str(k) for k in kinds} - set(_SYMBOLS)) if isinstance(kinds, list) else []
    if not isinstance(kinds, list) or len(kinds) != config["num_hidden_layers"] or unknown:
        raise ValueError(
            f"config.json layer_types={kinds!r}: expected one of "
            f"{', '.join(sorted(_SYMBOLS))} for each of num_hidden_layers="
            f"{config['num_hidden_layers']}"
        )
    return "".join(_SYMBOLS[kind] + ("E" if experts else "-") for kind in kinds)


def _positions(config: dict) -> str:
    kind = config.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ValueError(f"config.json position_embedding_type={kind!r}: expected \"rope\", "
                         "\"nope\" or null")  # fmt: skip
    return "rope" if kind == "rope" else "none"


def _settings(config: dict) -> dict:
    shared = shared_width(config, 1024)
    if not shared:
        raise ValueError("config.json shared_intermediate_size=0: Granite 4's layers always "
                         "add the shared MLP, mp needs its width")  # fmt: skip
    experts = bool(config.get("num_local_experts", _DEFAULTS["num_local_experts"]))
    pattern = _pattern(config, experts)
    base = llama_settings(config | {"intermediate_size": shared}, rms_norm_eps=1e-6,
                          max_positions=2048)  # fmt: skip
    settings = base | scale_settings(config) | mamba_settings(config) | {
        "num_layers": len(pattern), "hybrid_layer_pattern": pattern,
        "position_embedding_type": _positions(config),
    }  # fmt: skip
    if not experts:
        return settings
    return settings | expert_settings(config) | {
        "moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": False,
    }  # fmt: skip


# --- settings -> config.json -------------------------------------------------------------


def _mlp_keys(settings: dict, shapes: dict, experts: bool) -> dict:
    if not experts:
        return {"intermediate_size": shapes["ffn"], "shared_intermediate_size": shapes["ffn"],
                "num_local_experts": 0, "num_experts_per_tok": _DEFAULTS["num_experts_per_tok"],
                "router_aux_loss_coef": _DEFAULTS["router_aux_loss_coef"]}  # fmt: skip
    if not shapes.get("shared_ffn"):
        raise ValueError("the granitemoehybrid export needs a shared expert beside the experts")
    return {
        "intermediate_size": shapes["expert_ffn"], "shared_intermediate_size": shapes["shared_ffn"],
        "num_local_experts": shapes["experts"],
        "num_experts_per_tok": check_routing(settings, "granitemoehybrid", False),
        "router_aux_loss_coef": aux_loss_coef(settings),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    symbols, mlp = mixers(settings, "granitemoehybrid", "-E")
    experts = mlp == "E"
    positions = settings.get("position_embedding_type", "rope")
    if positions not in ("rope", "none"):
        raise ValueError(f"model_config position_embedding_type={positions!r}: "
                         "granitemoehybrid computes rope or none")  # fmt: skip
    computes, keys = scale_keys(settings)
    config = base_config(settings, shapes | {"ffn": None, "layers": len(symbols)}, tokens, dtype,
                         "granitemoehybrid", **computes, position_embedding_type=positions,
                         moe_shared_expert_gate=False)  # fmt: skip
    config = head_dim_where_it_differs(config, shapes)  # GraniteMoeHybridConfig has none
    return config | keys | mamba_config(settings, shapes["hidden"]) | _mlp_keys(
        settings, shapes, experts) | {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "layer_types": [_LAYER_TYPES[symbol] for symbol in symbols],
        "position_embedding_type": "rope" if positions == "rope" else None,
        "attention_bias": False, "use_cache": True, "output_router_logits": False,
    }  # fmt: skip


FAMILY = Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", RULES, _settings, _config,
                prepare=in_memory_names, hf_layer=pair_layer)  # fmt: skip
