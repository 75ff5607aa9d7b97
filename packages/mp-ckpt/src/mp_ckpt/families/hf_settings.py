"""config.json <-> a model's settings under Megatron's names: what the Llama-style
families share.

    llama_settings(config)                       a Llama-style config.json -> settings
    llama_config(settings, shapes, tokens, ...)  settings -> a Llama-style config.json

The settings are those a checkpoint keeps in common["model_config"] (and
TransformerConfig's field names): the shapes, normalization, activation,
rotary embeddings, dropouts and init std. What only a tokenizer knows (the
bos / eos / pad ids) travels beside them (mp_ckpt.hf.tokenizer). A config
mp cannot compute the same way (another activation, another rotary scaling)
is refused with the field and value, never imported approximately.

Rotary embeddings: transformers 5 writes the base and the scaling under
"rope_parameters" ({"rope_theta", "rope_type", ...}); earlier versions wrote a
top-level "rope_theta" and "rope_scaling". Both are read; both are written, so
that either version loads the export. rope_type "default" is plain RoPE,
"linear" divides the frequencies by its factor (rotary_seq_len_interpolation_factor
divides the positions: the same angles) and "llama3" is Llama 3.1's rescaling
(use_rope_scaling with its four settings).
"""

from __future__ import annotations

__all__ = [
    "base_config",
    "head_dim_where_it_differs",
    "llama_config",
    "llama_settings",
    "refuse",
    "rope_parameters",
    "rope_scaling",
    "token_ids",
]

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")  # fmt: skip
_LLAMA3_FIELDS = ("rope_scaling_factor", "rope_scaling_low_freq_factor",
                  "rope_scaling_high_freq_factor",
                  "rope_scaling_original_max_position_embeddings")  # fmt: skip


def llama_settings(config: dict, *, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                   max_positions: int = 2048) -> dict:  # fmt: skip
    """Settings of a Llama-style config.json (attention without biases, RMSNorm, gated
    silu, RoPE); the keyword arguments are the defaults of a key config.json may omit
    (Mixtral's and Qwen2-MoE's differ from Llama's)."""
    heads = config["num_attention_heads"]
    refuse(config, "hidden_act", "silu")
    refuse(config, "attention_bias", False)
    refuse(config, "mlp_bias", False)
    max_positions = config.get("max_position_embeddings", max_positions)
    return {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
        "ffn_hidden_size": config["intermediate_size"], "normalization": "RMSNorm",
        "activation": "swiglu", "position_embedding_type": "rope",
        **_rope_settings(config, max_positions, rope_theta),
        "layernorm_epsilon": config.get("rms_norm_eps", rms_norm_eps), "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0, "attention_dropout": config.get("attention_dropout", 0.0),
        "init_method_std": config.get("initializer_range", 0.02),
        "vocab_size": config["vocab_size"], "max_position_embeddings": max_positions,
    }  # fmt: skip


def _rope_settings(config: dict, max_positions: int, default_theta: float) -> dict:
    """rotary_base and the scaling fields, from either form of config.json."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, dict) or any(isinstance(v, dict) for v in parameters.values()):
        raise ValueError(
            f"config.json rope_parameters={parameters!r}: mp reads one set of rotary "
            "parameters for every layer"
        )
    theta = parameters.get("rope_theta", config.get("rope_theta", default_theta))
    if float(theta) != int(theta):
        raise ValueError(f"config.json rope_theta={theta!r}: rotary_base is an integer in mp")
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    settings = {"rotary_base": int(theta), "use_rope_scaling": False}
    if kind == "default":
        return settings
    if kind == "linear":  # frequencies / factor: the same angles as positions / factor
        if "factor" not in parameters:
            raise ValueError("config.json rope_type='linear' without factor")
        return settings | {"rotary_seq_len_interpolation_factor": parameters["factor"]}
    if kind != "llama3":
        raise ValueError(
            f"config.json rope_type={kind!r}: mp implements the RoPE types 'default', "
            "'linear' and 'llama3'"
        )
    given = {"original_max_position_embeddings": max_positions} | parameters
    missing = [k for k in _LLAMA3_KEYS if k not in given]
    if missing:
        raise ValueError(f"config.json rope_type='llama3' without {', '.join(missing)}")
    settings["use_rope_scaling"] = True
    for key, field in zip(_LLAMA3_KEYS, _LLAMA3_FIELDS, strict=True):
        settings[field] = given[key]
    return settings


def refuse(config: dict, key: str, supported: object) -> None:
    """Raises unless config[key] (when present) is the one value mp computes."""
    if key in config and config[key] != supported:
        raise ValueError(f"config.json {key}={config[key]!r}: mp computes only {key}={supported!r}")


# --- export ------------------------------------------------------------------------------


LLAMA_STYLE = {
    "normalization": "RMSNorm", "apply_layernorm_1p": False, "activation": "swiglu",
    "quick_geglu": False, "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
    "position_embedding_type": "rope", "rotary_percent": 1.0, "qk_layernorm": False,
    "softmax_type": "vanilla", "window_size": None, "window_attn_skip_freq": None,
    "rotary_interleaved": False, "no_rope_freq": None, "qk_l2_norm": False,
    "moe_apply_probs_on_input": False, "attention_chunk_size": None,
    "attn_temperature_floor_scale": None, "attn_temperature_scale": 0.1,
    "moe_latent_size": None, "sublayer_norm": "input", "qk_layernorm_scope": "head",
    "window_rotary_base": None, "scale_word_embeddings": False, "query_pre_attn_scalar": None,
    "word_embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
    "query_log_scale_beta": None,
}  # fmt: skip
"""What a Llama-style family computes, under TransformerConfig's names (and defaults)."""


def check_computes(settings: dict, model_type: str, computes: dict) -> None:
    """Raises unless each setting has the value the family computes (an absent one counts
    as TransformerConfig's default, which `computes` holds for the fields it names)."""
    for field, value in computes.items():
        have = settings.get(field, value)
        if isinstance(value, tuple) and isinstance(have, list):
            have = tuple(have)
        if have != value:
            raise ValueError(
                f"model_config {field}={have!r}: {model_type} computes only {field}={value!r}"
            )


def base_config(settings: dict, shapes: dict, tokens: dict, dtype: str, model_type: str,
                **computes) -> dict:  # fmt: skip
    """The keys every Llama-style config.json of transformers 5 has. shapes: vocab,
    hidden, layers, heads, groups, head_dim, ffn, tied; tokens: bos/eos/pad ids.
    Refuses settings the family does not compute: LLAMA_STYLE's, with `computes` over
    them."""
    check_computes(settings, model_type, LLAMA_STYLE | computes)
    return {
        "vocab_size": shapes["vocab"], "hidden_size": shapes["hidden"],
        "intermediate_size": shapes["ffn"], "num_hidden_layers": shapes["layers"],
        "num_attention_heads": shapes["heads"], "num_key_value_heads": shapes["groups"],
        "head_dim": shapes["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": settings.get("max_position_embeddings",
                                                settings.get("seq_length", 2048)),
        "rms_norm_eps": settings.get("layernorm_epsilon", 1e-5),
        "rope_parameters": rope_parameters(settings),
        "attention_dropout": settings.get("attention_dropout", 0.0),
        "initializer_range": settings.get("init_method_std", 0.02),
        "tie_word_embeddings": shapes["tied"], **token_ids(tokens), "dtype": dtype,
    }  # fmt: skip


def head_dim_where_it_differs(config: dict, shapes: dict) -> dict:
    """config without its head_dim where the heads are hidden / heads wide: the families
    whose config.json has no head_dim, or writes it only where it differs."""
    if shapes["head_dim"] * shapes["heads"] == shapes["hidden"]:
        return {k: v for k, v in config.items() if k != "head_dim"}
    return config


def llama_config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    """LlamaForCausalLM's config.json, with the rotary keys earlier transformers read."""
    theta, scaling = rope_scaling(settings)
    config = base_config(settings, shapes, tokens, dtype, "llama")
    del config["dtype"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | config | {
        "rope_theta": theta, "rope_scaling": scaling, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype}  # fmt: skip


def rope_scaling(settings: dict) -> tuple[float, dict | None]:
    """(rope_theta, the rope_scaling entries or None) of a model's settings."""
    theta = float(settings.get("rotary_base", 10000))
    scaling = None
    if settings.get("use_rope_scaling"):
        defaults = (8.0, 1.0, 4.0, 8192)  # Megatron's (TransformerConfig's) defaults
        scaling = {"rope_type": "llama3"} | {
            key: settings.get(field, default)
            for key, field, default in zip(_LLAMA3_KEYS, _LLAMA3_FIELDS, defaults, strict=True)
        }
    linear = settings.get("rotary_seq_len_interpolation_factor")
    if linear is not None:
        if scaling is not None:
            raise ValueError(
                f"model_config rotary_seq_len_interpolation_factor={linear!r} with "
                "use_rope_scaling=True: config.json holds one rope_type"
            )
        scaling = {"rope_type": "linear", "factor": linear}
    return theta, scaling


def token_ids(tokens: dict) -> dict:
    return {k: tokens.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def rope_parameters(settings: dict) -> dict:
    """config.json's rope_parameters of a model's settings (transformers 5's form)."""
    theta, scaling = rope_scaling(settings)
    return {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
