"""EXAONE 4.0 (model_type "exaone4", Exaone4ForCausalLM): OLMo 2's placement of the norms
(each sublayer's output normalized: post_attention_layernorm, post_feedforward_layernorm,
mp's sublayer_norm "output") with Qwen3's per-head query and key norms. With a
sliding_window (the 32B model), the layers layer_types marks "sliding_attention" (three in
four) attend through the window with rotary embeddings and the others attend fully
without (NoPE: mp's no_rope_freq lists them); without one (the 1.2B model) every layer
attends fully with rotary embeddings.

Hugging Face (model.layers.{i}.)        mp (decoder.layers.{i}.)
    self_attn.*, mlp.*                  as Qwen3's (llama_style.py)
    post_attention_layernorm.weight     post_self_attn_layernorm.weight
    post_feedforward_layernorm.weight   post_mlp_layernorm.weight

sliding_window_pattern is written as the interval of the windowed layers where one gives
them (4 for three in four), else transformers' default 4 (layer_types, written beside it,
is what transformers reads). Refused besides Llama's: layer_types with sliding layers and
no sliding_window.
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules
from mp_ckpt.families.nope import rotating_of
from mp_ckpt.families.olmo2 import output_norm_rules
from mp_ckpt.families.table import Family
from mp_ckpt.families.window import layer_types, sliding_window, window_settings

__all__ = ["FAMILY"]

_NORMS = {"sublayer_norm": "output", "qk_layernorm": True}
_PATTERN = 4
"""Exaone4Config's sliding_window_pattern."""
RULES = (*model_rules(), *attention_rules(qk_norm=True), *output_norm_rules(),
         *dense_mlp_rules())  # fmt: skip


def _settings(config: dict) -> dict:
    base = llama_settings(config, rms_norm_eps=1e-5, max_positions=2048) | _NORMS
    layers = config["num_hidden_layers"]
    sliding = config.get("sliding_window")
    types = config.get("layer_types") or ["full_attention"] * layers
    if sliding is None:
        if set(types) != {"full_attention"}:
            raise ValueError(f"config.json layer_types={types!r} with sliding_window null: "
                             "without a window every EXAONE 4.0 layer attends fully")  # fmt: skip
        return base
    windows = window_settings(sliding, types, layers)
    full = [int(t == "full_attention") for t in types]  # no rotary embeddings there
    return base | windows | ({"no_rope_freq": full} if any(full) else {})


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers = shapes["layers"]
    window = settings.get("window_size")
    types = layer_types(settings, layers)
    full = [bool(window) and t == "full_attention" for t in types]
    if [not r for r in rotating_of(settings, layers)] != full:
        raise ValueError(
            f"model_config no_rope_freq={settings.get('no_rope_freq')!r}: EXAONE 4.0's layers "
            "without rotary embeddings are its full-attention layers beside windowed ones"
        )
    computes = _NORMS | {"window_size": tuple(window) if window else None,
                         "window_attn_skip_freq": settings.get("window_attn_skip_freq"),
                         "no_rope_freq": settings.get("no_rope_freq")}  # fmt: skip
    config = base_config(settings, shapes, tokens, dtype, "exaone4", **computes)
    config = head_dim_where_it_differs(config, shapes)  # Exaone4Config has none
    freq = settings.get("window_attn_skip_freq")
    pattern = freq if isinstance(freq, int) and not isinstance(freq, bool) else _PATTERN
    return config | {
        "architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4",
        "sliding_window": sliding_window(settings, layers),
        "sliding_window_pattern": pattern if window else 0, "layer_types": types,
    }  # fmt: skip


FAMILY = Family("exaone4", "Exaone4ForCausalLM", RULES, _settings, _config)
