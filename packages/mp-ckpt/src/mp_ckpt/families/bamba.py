"""Bamba (model_type "bamba", BambaForCausalLM: Bamba-9B): each Hugging Face layer a mixer,
a Mamba-2 mixer or self-attention on the layers attn_layer_indices lists, then a SwiGLU
MLP, each behind its own RMSNorm; attention rotates the first half of each head
(transformers fixes partial_rotary_factor at 0.5: rotary_percent). mp builds it as
Granite 4's layers are built, two hybrid layers for each (mixer_pairs.py: Hugging Face
layer j's input_layernorm and mixer are mp's layer 2j, M or *), its MLP mp's layer
2j + 1 (-): pre_ff_layernorm.weight its pre_mlp_layernorm.weight,
feed_forward.{gate,up,down}_proj.weight its mlp.* as Llama's.

model.embed_tokens.weight, model.final_layernorm.weight and lm_head.weight are
embedding.word_embeddings.weight, decoder.final_layernorm.weight and output_layer.weight.
The Mamba mixers' keys as mamba_rules.py reads them; rms_norm_eps (the mixers' gated
norms' too) -> layernorm_epsilon.

Refused (with the key and value): hidden_act other than silu, attention_bias, mlp_bias,
a z_loss_coefficient other than 0 (a z-loss over the logits in training, which mp's
loss does not add), and the Mamba keys mamba_rules.py refuses.
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import (
    base_config,
    head_dim_where_it_differs,
    llama_settings,
)
from mp_ckpt.families.llama_style import dense_mlp_rules
from mp_ckpt.families.mamba_rules import mamba_config, mamba_settings
from mp_ckpt.families.mixer_pairs import mixer_rules, mixers, pair_layer
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY"]

_L = "model.layers.{i}."
RULES = (
    Rule(("embedding.word_embeddings.weight",), "model.embed_tokens.weight", "model"),
    Rule(("decoder.final_layernorm.weight",), "model.final_layernorm.weight", "model"),
    Rule(("output_layer.weight",), "lm_head.weight", "model",
         when=lambda s: bool(s.get("untie_embeddings_and_output_weights"))),
    *mixer_rules(_L),
    Rule(("pre_mlp_layernorm.weight",), _L + "pre_ff_layernorm.weight", "dense"),
    *dense_mlp_rules(block="feed_forward"),
)  # fmt: skip
_ROTARY_PERCENT = 0.5
"""transformers' Bamba rotates half of each head, whatever config.json says."""


def _settings(config: dict) -> dict:
    if config.get("z_loss_coefficient"):
        raise ValueError(f"config.json z_loss_coefficient={config['z_loss_coefficient']!r}: "
                         "mp's loss adds no z-loss over the logits; only 0 is "
                         "computed")  # fmt: skip
    layers = config["num_hidden_layers"]
    attention = config.get("attn_layer_indices") or []
    if not isinstance(attention, list) or not set(attention) <= set(range(layers)):
        raise ValueError(f"config.json attn_layer_indices={attention!r}: expected indices of "
                         f"the num_hidden_layers={layers} layers")  # fmt: skip
    pattern = "".join(("*" if j in attention else "M") + "-" for j in range(layers))
    base = llama_settings(config, rms_norm_eps=1e-5, max_positions=262144)
    return base | mamba_settings(config) | {
        "num_layers": len(pattern), "hybrid_layer_pattern": pattern,
        "rotary_percent": _ROTARY_PERCENT,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    symbols, _ = mixers(settings, "bamba", "-")
    config = base_config(settings, shapes | {"layers": len(symbols)}, tokens, dtype, "bamba",
                         rotary_percent=_ROTARY_PERCENT)  # fmt: skip
    config = head_dim_where_it_differs(config, shapes)  # BambaConfig has none
    attention = [j for j, symbol in enumerate(symbols) if symbol == "*"]
    return config | mamba_config(settings, shapes["hidden"]) | {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "attn_layer_indices": attention or None,
        "rope_parameters": config["rope_parameters"] | {"partial_rotary_factor": _ROTARY_PERCENT},
        "attention_bias": False, "mlp_bias": False, "use_cache": True, "num_logits_to_keep": 1,
        "z_loss_coefficient": 0.0,
    }  # fmt: skip


FAMILY = Family("bamba", "BambaForCausalLM", RULES, _settings, _config, hf_layer=pair_layer)
