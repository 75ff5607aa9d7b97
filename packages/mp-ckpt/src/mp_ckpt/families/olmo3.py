"""OLMo 3 (model_type "olmo3", Olmo3ForCausalLM): OLMo 2's layers and tensors (olmo2.py)
with sliding-window attention on the layers layer_types marks "sliding_attention" (three
in four by default; mp's window_size and window_attn_skip_freq, window.py), and rotary
parameters per layer type:

    rope_parameters.full_attention      the model's rotary embeddings: plain RoPE, or YaRN
                                        (position_embedding_type "yarn", yarn.py), as the
                                        released long-context models scale them
    rope_parameters.sliding_attention   plain RoPE: window_rotary_base when its base differs
                                        or the full layers are scaled, else none

An explicit YaRN attention_factor is read where it is the one mp derives (0.1 ln(factor)
+ 1, as the released configs hold it) and written back; another is refused.

Refused besides OLMo 2's: a sliding layer's rope_type other than "default"
(layer_type_rope.py).
"""

from __future__ import annotations

import math

from mp_ckpt.families.hf_settings import (
    base_config,
    head_dim_where_it_differs,
    llama_settings,
    rope_parameters,
)
from mp_ckpt.families.layer_type_rope import nested_rope, split_rope, window_base
from mp_ckpt.families.olmo2 import OLMO2_NORMS, RULES
from mp_ckpt.families.table import Family
from mp_ckpt.families.window import layer_types, sliding_window, window_settings
from mp_ckpt.families.yarn import yarn_attention_factor, yarn_parameters, yarn_settings

__all__ = ["FAMILY"]

_THETA = 500000.0
"""Olmo3Config's default rope_theta."""


def _settings(config: dict) -> dict:
    full, local = split_rope(config, _THETA, _THETA)
    theta = full["rope_theta"]
    plain = {"rope_type": "default", "rope_theta": theta}
    kind = full.get("rope_type", "default")
    rope = plain if kind == "yarn" else full
    base = llama_settings(config | {"rope_parameters": rope}, rope_theta=_THETA,
                          rms_norm_eps=1e-5, max_positions=2048) | OLMO2_NORMS  # fmt: skip
    if kind == "yarn":
        yarn = {k: v for k, v in full.items() if k != "attention_factor"}
        base |= yarn_settings(yarn, base["max_position_embeddings"])
        derived, given = yarn_attention_factor(base), full.get("attention_factor")
        if given is not None and not math.isclose(given, derived, rel_tol=1e-9):
            raise ValueError(
                f"config.json rope_parameters.full_attention attention_factor={given!r}: mp "
                f"derives {derived!r} from the factor and mscales"
            )
    layers = config["num_hidden_layers"]
    default_types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                     for i in range(layers)]  # fmt: skip
    types = config.get("layer_types") or default_types
    windows = window_settings(config.get("sliding_window"), types, layers)
    return base | windows | window_base(types, full, local)


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers = shapes["layers"]
    window = settings.get("window_size")
    position = settings.get("position_embedding_type", "rope")
    computes = {"window_size": tuple(window) if window else None,
                "window_attn_skip_freq": settings.get("window_attn_skip_freq"),
                "window_rotary_base": settings.get("window_rotary_base"),
                "position_embedding_type": position}  # fmt: skip
    config = base_config(settings, shapes, tokens, dtype, "olmo3", **OLMO2_NORMS, **computes)
    config = head_dim_where_it_differs(config, shapes)  # Olmo3Config has none
    full = rope_parameters(settings)
    if position == "yarn":
        full = yarn_parameters(settings)
        full["attention_factor"] = yarn_attention_factor(settings)
    return config | {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False,
        "rope_parameters": nested_rope(settings, full),
        "sliding_window": sliding_window(settings, layers),
        "layer_types": layer_types(settings, layers),
    }  # fmt: skip


FAMILY = Family("olmo3", "Olmo3ForCausalLM", RULES, _settings, _config)
