"""Gemma 3 (model_type "gemma3_text", Gemma3ForCausalLM: the text model of Gemma 3 270M
to 27B): Llama's tensors with Gemma's choices, each an mp setting:

    sandwich norms: each sublayer's input and output      sublayer_norm "both"
    zero-centred RMSNorm weights, x (1 + w), queries and  apply_layernorm_1p, qk_layernorm
      keys normalized per head
    gated GELU (tanh approximation, gelu_pytorch_tanh)    activation "geglu", openai_gelu
    the embeddings times sqrt(hidden_size)                scale_word_embeddings
    scores scaled by query_pre_attn_scalar^-1/2           query_pre_attn_scalar
    sliding windows where layer_types says (five in six)  window_size, window_attn_skip_freq
    full layers: rope_theta (1e6), linear scaling on the  the model's rotary embeddings
      larger models
    sliding layers: plain RoPE of their own base (1e4)    window_rotary_base
                                                          (layer_type_rope.py)

Hugging Face (model.layers.{i}.)        mp (decoder.layers.{i}.)
    self_attn.{q,k,v,o}_proj, mlp.*     as Llama's (llama_style.py)
    self_attn.{q,k}_norm.weight         self_attention.{q,k}_layernorm.weight
    input_layernorm.weight              input_layernorm.weight
    post_attention_layernorm.weight     post_self_attn_layernorm.weight
    pre_feedforward_layernorm.weight    pre_mlp_layernorm.weight
    post_feedforward_layernorm.weight   post_mlp_layernorm.weight

Refused: another hidden_activation, logit soft-capping (Gemma 2's: attn_logit_softcapping,
final_logit_softcapping), bidirectional attention (EmbeddingGemma's), attention_bias, and
the image-and-text model_type "gemma3" (its text model converts alone).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse, rope_parameters
from mp_ckpt.families.layer_type_rope import nested_rope, split_rope, window_base
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules
from mp_ckpt.families.olmo2 import output_norm_rules
from mp_ckpt.families.table import Family, Rule
from mp_ckpt.families.window import layer_types, sliding_window, window_settings

__all__ = ["FAMILY"]

_GEMMA = {"activation": "geglu", "openai_gelu": True, "apply_layernorm_1p": True,
          "sublayer_norm": "both", "qk_layernorm": True, "scale_word_embeddings": True}  # fmt: skip
_PATTERN = 6
"""Gemma3TextConfig's sliding_window_pattern: every sixth layer attends fully."""


def _norm_rules() -> tuple[Rule, ...]:
    layer = "model.layers.{i}."
    inputs = (
        Rule(("input_layernorm.weight",), layer + "input_layernorm.weight"),
        Rule(("pre_mlp_layernorm.weight",), layer + "pre_feedforward_layernorm.weight"),
    )
    return (*inputs, *output_norm_rules())  # fmt: skip


RULES = (*model_rules(), *attention_rules(qk_norm=True), *_norm_rules(), *dense_mlp_rules())


def _settings(config: dict) -> dict:
    refuse(config, "hidden_activation", "gelu_pytorch_tanh")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        refuse(config, key, None)
    refuse(config, "use_bidirectional_attention", False)
    refuse(config, "hidden_act", "gelu_pytorch_tanh")  # Gemma 1's key, where given
    config = {k: v for k, v in config.items() if k != "hidden_act"}
    full, local = split_rope(config, 1000000.0, 10000.0)
    base = llama_settings(config | {"rope_parameters": full}, rms_norm_eps=1e-6,
                          max_positions=131072)  # fmt: skip
    layers = config["num_hidden_layers"]
    default_types = ["full_attention" if (i + 1) % _PATTERN == 0 else "sliding_attention"
                     for i in range(layers)]  # fmt: skip
    types = config.get("layer_types") or default_types
    windows = window_settings(config.get("sliding_window", 4096), types, layers)
    scalar = config.get("query_pre_attn_scalar", 256)
    return base | _GEMMA | windows | window_base(types, full, local) | {
        "query_pre_attn_scalar": scalar, "untie_embeddings_and_output_weights":
        not config.get("tie_word_embeddings", True),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers = shapes["layers"]
    window = settings.get("window_size")
    computes = _GEMMA | {
        "window_size": tuple(window) if window else None,
        "window_attn_skip_freq": settings.get("window_attn_skip_freq"),
        "window_rotary_base": settings.get("window_rotary_base"),
        "query_pre_attn_scalar": settings.get("query_pre_attn_scalar"),
    }  # fmt: skip
    config = base_config(settings, shapes, tokens, dtype, "gemma3_text", **computes)
    del config["hidden_act"]
    return config | {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": nested_rope(settings, rope_parameters(settings)),
        "query_pre_attn_scalar": settings.get("query_pre_attn_scalar"),
        "sliding_window": sliding_window(settings, layers),
        "layer_types": layer_types(settings, layers), "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }  # fmt: skip


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", RULES, _settings, _config)
