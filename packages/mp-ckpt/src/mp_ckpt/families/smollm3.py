"""SmolLM3 (model_type "smollm3", SmolLM3ForCausalLM): Llama's layers, of which every
no_rope_layer_interval-th (4: three rotating layers, then one without; or as
no_rope_layers lists them) has no rotary embeddings (NoPE: mp's no_rope_freq, nope.py),
with none of Llama 4's other NoPE features (no query temperature, no chunked attention,
no query/key norms). Its tensors are Llama's (llama_style.py); the released 3B model
ties the output layer to the embedding.

Refused besides Llama's: a sliding window (use_sliding_window with sliding_window, on
the NoPE layers in transformers), and layer_types other than transformers' own.
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.nope import interval_of, rotating_layers, rotating_of
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_INTERVAL = 4
"""SmolLM3Config's no_rope_layer_interval."""
RULES = (*model_rules(), *attention_rules(), *norm_rules(), *dense_mlp_rules())


def _settings(config: dict) -> dict:
    if config.get("use_sliding_window") and config.get("sliding_window") is not None:
        raise ValueError(
            f"config.json use_sliding_window with sliding_window={config['sliding_window']!r}: "
            "mp converts SmolLM3 without windows (its released models have none)"
        )
    layers = config["num_hidden_layers"]
    rotating = rotating_layers(config, layers, _INTERVAL)
    types = config.get("layer_types")
    if types is not None and list(types) != ["full_attention"] * layers:
        raise ValueError(
            f"config.json layer_types={types!r}: without a window every SmolLM3 layer is "
            "full_attention"
        )
    base = llama_settings(config, rope_theta=2000000.0, max_positions=32768)
    return base | {"no_rope_freq": None if all(rotating) else [1 - r for r in rotating]}


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers = shapes["layers"]
    rotating = rotating_of(settings, layers)
    config = base_config(settings, shapes, tokens, dtype, "smollm3",
                         no_rope_freq=settings.get("no_rope_freq"))  # fmt: skip
    no_rope = [i for i, r in enumerate(rotating) if not r]
    return config | {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
        "no_rope_layers": rotating, "no_rope_layer_interval": interval_of(no_rope, layers, 4),
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * layers, "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


FAMILY = Family("smollm3", "SmolLM3ForCausalLM", RULES, _settings, _config)
