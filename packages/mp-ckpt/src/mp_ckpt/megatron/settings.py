"""Megatron-LM's saved args -> mp's model settings (TransformerConfig's names).

    model_config_from_megatron(args, vocab_size)    the settings import-megatron records

A setting mp does not compute the same way (heterogeneous layers, several load-balancing
losses, ...) is refused with its name and value.
Multi-latent attention's settings are its widths and rotary embeddings (_mla_settings),
with DeepSeek's sparse attention its indexer's (sparse_attention.py);
multi-token prediction's its number of modules and its loss scale; a hybrid model's
its layer pattern and Mamba widths (_hybrid_settings).
"""

from __future__ import annotations

from mp_ckpt.megatron.linear_attention import linear_attention_settings
from mp_ckpt.megatron.sparse_attention import sparse_attention_settings

__all__ = [
    "MAMBA_COPIED",
    "MLA_COPIED",
    "MLA_YARN",
    "MOE_COPIED",
    "YARN_ARGS",
    "gated",
    "held_mtp_modules",
    "model_config_from_megatron",
    "moe_settings_from_megatron",
]

# Megatron settings that change the computation in ways mp does not implement.
_REFUSED = (("heterogeneous_layers_config_path", None),)
"""(apply_residual_connection_post_layernorm is not one: megatron-core reads it nowhere, its
layers add the residual from before the norm whatever it says.)"""
_HYBRID_SYMBOLS = "MG*-E|"
"""The layers of a hybrid_layer_pattern mp builds (Mamba, attention, MLP, MoE) and its
pipeline segments' separator."""
MAMBA_COPIED = {"mamba_num_heads": None, "mamba_head_dim": 64, "mamba_num_groups": 8,
                 "mamba_state_dim": 128}  # fmt: skip
"""A Mamba mixer's widths, under Megatron's defaults (mp's fields have its names)."""
_MAMBA_NORM_EPSILON = 1e-5
"""The epsilon of megatron-core's Mamba mixer's gated norm, whatever --norm-epsilon says."""


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


_MUP_COPIED = {"mup_base_hidden_size": None, "mup_embedding_mult": 1.0, "mup_output_mult": 1.0,
               "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}  # fmt: skip
"""Maximal Update Parameterization's settings, under Megatron's defaults (mp's names)."""


def _mup_settings(args) -> dict:
    """muP's settings (the logits', the embedding's and the attention's multipliers follow
    from them) and the embedding's init std; only those that differ from the defaults."""
    settings = {}
    if _arg(args, "embedding_init_method_std") is not None:
        settings["embedding_init_method_std"] = float(args.embedding_init_method_std)
    if not _arg(args, "use_mup", False):
        return settings
    settings["use_mup"] = True
    for name, default in _MUP_COPIED.items():
        value = _arg(args, name, default)
        if value != default:
            settings[name] = value
    return settings


def held_mtp_modules(settings: dict) -> int:
    """The multi-token prediction modules the tensors hold: mtp_num_layers, or one applied
    at every depth with mtp_use_repeated_layer."""
    depths = settings.get("mtp_num_layers") or 0
    return 1 if depths and settings.get("mtp_use_repeated_layer") else depths


def gated(args) -> bool:
    """Whether Megatron's fc1 holds [gate; up] (swiglu, or gpt-oss's quick_geglu)."""
    return bool(_arg(args, "swiglu", False) or _arg(args, "quick_geglu", False))


def model_config_from_megatron(args, vocab_size: int, where: str = "args") -> dict:
    """mp's model settings (Megatron's names) from Megatron's saved args; vocab_size is
    the padded vocabulary the embedding holds."""

    def refuse(name: str, supported) -> None:
        value = _arg(args, name, supported)
        if value != supported and value is not None:
            raise ValueError(f"{where}: {name}={value!r}: mp imports only {name}={supported!r}")

    for name, supported in _REFUSED:
        refuse(name, supported)
    heads = args.num_attention_heads
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else None
    normalization = _arg(args, "normalization", "LayerNorm")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(
            f"{where}: normalization={normalization!r}: mp computes LayerNorm, RMSNorm"
        )
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "yarn", "none"):
        raise ValueError(
            f"{where}: position_embedding_type={position!r}: mp computes learned_absolute, "
            "rope, yarn and none"
        )
    if _arg(args, "swiglu"):
        activation = "swiglu"
    elif _arg(args, "squared_relu"):
        activation = "squared_relu"
    else:
        activation = "gelu"
    epsilon = _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5))
    seq_length = _arg(args, "seq_length")
    settings = {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size,
        "num_attention_heads": heads, "num_query_groups": groups or heads,
        "kv_channels": _arg(args, "kv_channels") or args.hidden_size // heads,
        "ffn_hidden_size": _arg(args, "ffn_hidden_size") or 4 * args.hidden_size,
        "normalization": normalization, "activation": activation,
        "openai_gelu": bool(_arg(args, "openai_gelu", False)),
        "layernorm_epsilon": epsilon, "position_embedding_type": position,
        "rotary_base": int(_arg(args, "rotary_base", 10000)),
        "rotary_percent": float(_arg(args, "rotary_percent", 1.0)),
        "rotary_seq_len_interpolation_factor": _arg(args, "rotary_seq_len_interpolation_factor"),
        "use_rope_scaling": bool(_arg(args, "use_rope_scaling", False)),
        "add_bias_linear": bool(_arg(args, "add_bias_linear", True)),
        "add_qkv_bias": bool(_arg(args, "add_qkv_bias", False)),
        "qk_layernorm": bool(_arg(args, "qk_layernorm", False)),
        # gpt-oss's activation: fc1 is [gate; up] as for swiglu (Megatron's quick_geglu)
        "quick_geglu": bool(_arg(args, "quick_geglu", False)),
        "glu_linear_offset": float(_arg(args, "glu_linear_offset", 0.0) or 0.0),
        "activation_func_clamp_value": _arg(args, "activation_func_clamp_value"),
        # the same zero-centered weight in both (Megatron's layernorm_zero_centered_gamma)
        "apply_layernorm_1p": bool(_arg(args, "apply_layernorm_1p", False)),
        "untie_embeddings_and_output_weights": bool(
            _arg(args, "untie_embeddings_and_output_weights", False)),
        "hidden_dropout": _arg(args, "hidden_dropout", 0.1),
        "attention_dropout": _arg(args, "attention_dropout", 0.1),
        "init_method_std": _arg(args, "init_method_std", 0.02),
        "vocab_size": vocab_size,
        "max_position_embeddings": _arg(args, "max_position_embeddings") or seq_length,
    }  # fmt: skip
    settings |= _attention_settings(args, position)
    settings |= _mup_settings(args)
    settings |= _mla_settings(args, where)
    if _arg(args, "mtp_num_layers"):  # multi-token prediction (DeepSeek-V3)
        settings["mtp_num_layers"] = int(args.mtp_num_layers)
        settings["mtp_loss_scaling_factor"] = float(_arg(args, "mtp_loss_scaling_factor", 0.1))
        if _arg(args, "mtp_use_repeated_layer", False):  # one module, at every depth
            settings["mtp_use_repeated_layer"] = True
    settings |= _hybrid_settings(args, epsilon, where)
    settings |= linear_attention_settings(args, where)  # gated DeltaNet layers (Qwen3-Next)
    settings |= sparse_attention_settings(args, where)  # DeepSeek's sparse attention (V3.2)
    if settings.get("hybrid_layer_pattern") and "/" not in settings["hybrid_layer_pattern"]:
        # a hybrid model's modules come from the pattern's "/" parts alone
        for name in ("mtp_num_layers", "mtp_loss_scaling_factor", "mtp_use_repeated_layer"):
            settings.pop(name, None)
    if seq_length is not None:
        settings["seq_length"] = seq_length
    if settings["use_rope_scaling"]:
        settings["rope_scaling_factor"] = _arg(args, "rope_scaling_factor", 8.0)
    if _arg(args, "num_experts"):
        settings |= moe_settings_from_megatron(args, settings, where)
        if settings.get("hybrid_layer_pattern"):  # the pattern's E layers are the MoE ones
            settings["moe_layer_freq"] = [1]
    return settings


def _hybrid_settings(args, epsilon: float, where: str) -> dict:
    """A hybrid model's (HybridModel's) layers and Mamba widths; {} for a GPT model.
    Megatron-LM reads the layers from hybrid_layer_pattern (the older
    hybrid_override_pattern is the same string), its multi-token prediction modules from
    the "/" parts (mtp_num_layers: their number); a model whose layers came from
    hybrid_attention_ratio / hybrid_mlp_ratio alone records no pattern and is refused."""
    pattern = _arg(args, "hybrid_layer_pattern") or _arg(args, "hybrid_override_pattern")
    if not pattern:
        if _arg(args, "is_hybrid_model"):
            raise ValueError(f"{where}: is_hybrid_model without hybrid_layer_pattern: mp reads "
                             "a hybrid model's layers from its pattern")  # fmt: skip
        return {}
    main, *modules = pattern.split("/")
    unknown = sorted(set("".join([main, *modules])) - set(_HYBRID_SYMBOLS))
    if unknown:
        raise ValueError(f"{where}: hybrid_layer_pattern={pattern!r}: mp builds the layers "
                         f"M, G, *, - and E, not {', '.join(unknown)}")  # fmt: skip
    out = {"hybrid_layer_pattern": pattern if any(modules) else main}
    if any(modules):  # Megatron-LM's unified pattern: one module per "/" part
        if len(set(modules)) != 1 or "|" in "".join(modules):
            raise ValueError(f"{where}: hybrid_layer_pattern={pattern!r}: the multi-token "
                             "prediction modules' parts must be alike, without '|'")  # fmt: skip
        out["mtp_num_layers"] = len(modules)
        out["mtp_loss_scaling_factor"] = float(_arg(args, "mtp_loss_scaling_factor", 0.1))
    out |= {name: _arg(args, name) or default for name, default in MAMBA_COPIED.items()}
    if "M" in main and epsilon != _MAMBA_NORM_EPSILON:
        raise ValueError(
            f"{where}: norm_epsilon={epsilon!r}: megatron-core's Mamba mixers normalize with "
            f"{_MAMBA_NORM_EPSILON} whatever it says, mp's with layernorm_epsilon"
        )
    return out


# Megatron's args -> mp's field: YaRN (the command line drops the prefix of three).
YARN_ARGS = {
    "rotary_scaling_factor": ("yarn_rotary_scaling_factor", 1.0),
    "yarn_original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "yarn_beta_fast": ("yarn_beta_fast", 32.0), "yarn_beta_slow": ("yarn_beta_slow", 1.0),
    "mscale": ("yarn_mscale", 1.0), "mscale_all_dim": ("yarn_mscale_all_dim", 0.0),
    "yarn_correction_range_round_to_int": ("yarn_correction_range_round_to_int", True),
}  # fmt: skip


def _attention_settings(args, position: str) -> dict:
    """Sinks, windows and YaRN (gpt-oss's attention); interleaved rotary embeddings, NoPE
    layers and L2-normalized queries and keys (Llama 4's; Megatron normalizes on every
    layer: qk_l2_norm_layers "all"), at Megatron's defaults when absent."""
    window = _arg(args, "window_size")
    out = {
        "softmax_type": _arg(args, "softmax_type") or "vanilla",
        "window_size": tuple(window) if window else None,
        "window_attn_skip_freq": _arg(args, "window_attn_skip_freq"),
        "rotary_interleaved": bool(_arg(args, "rotary_interleaved", False)),
        "no_rope_freq": _arg(args, "no_rope_freq"),
        "qk_l2_norm": bool(_arg(args, "qk_l2_norm", False)),
    }
    if position == "yarn":
        for arg, (field, default) in YARN_ARGS.items():
            value = _arg(args, arg)
            out[field] = default if value is None else value
    return out


# Multi-latent attention's args, copied (mp's fields have Megatron's names and defaults).
MLA_COPIED = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
              "qk_pos_emb_head_dim": 64, "v_head_dim": 128}  # fmt: skip
# Megatron's MLA rotates by its own YaRN (MLATransformerConfig): the scaling factor and the
# two mscales come from the args (--rotary-scaling-factor, --mscale, --mscale-all-dim);
# the rest are MLATransformerConfig's defaults, which no argument reaches.
MLA_YARN = {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0,
            "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}  # fmt: skip


def _mla_settings(args, where: str) -> dict:
    """Multi-latent attention's settings: its widths, and rope_type (None: Megatron's
    MLA default, YaRN) with YaRN's fields."""
    if not _arg(args, "multi_latent_attention", False):
        return {}
    out = {"multi_latent_attention": True}
    out |= {name: _arg(args, name, default) for name, default in MLA_COPIED.items()}
    rope_type = _arg(args, "rope_type") or "yarn"
    factor = float(_arg(args, "rotary_scaling_factor", 1.0) or 1.0)
    mscale_all_dim = float(_arg(args, "mscale_all_dim", 0.0) or 0.0)
    out["rope_type"] = rope_type
    if rope_type == "yarn":
        out |= MLA_YARN | {
            "yarn_rotary_scaling_factor": factor,
            "yarn_mscale": float(_arg(args, "mscale", 1.0)),
            "yarn_mscale_all_dim": mscale_all_dim,
        }
    elif factor > 1.0 and mscale_all_dim != 0.0:
        # Megatron's MLA scales the softmax by YaRN's mscale whatever its rope_type
        raise ValueError(
            f"{where}: rope_type='rope' with rotary_scaling_factor={factor} and "
            f"mscale_all_dim={mscale_all_dim}: Megatron's MLA then scales its softmax by "
            "YaRN's mscale, which mp's computes only with rope_type 'yarn'"
        )
    return out


# Megatron MoE settings that change the computation in ways mp does not implement.
_MOE_REFUSED = (
    ("moe_latent_size", None),
    ("moe_router_force_load_balancing", False), ("moe_use_legacy_grouped_gemm", False),
)  # fmt: skip
# Copied as they are (mp's TransformerConfig has Megatron's names and meanings).
MOE_COPIED = {
    "moe_router_topk": 2, "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
    "moe_z_loss_coeff": None, "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3, "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs",
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    "moe_grouped_gemm": False, "moe_router_dtype": None,
    "moe_router_num_groups": None, "moe_router_group_topk": None,
    "moe_apply_probs_on_input": False, "moe_input_jitter_eps": None,
    "moe_router_quantile_balancing_ema": 0.0,
}  # fmt: skip


def moe_settings_from_megatron(args, settings: dict, where: str) -> dict:
    """mp's mixture-of-experts settings from Megatron's saved args."""
    for name, supported in _MOE_REFUSED:
        value = _arg(args, name, supported)
        if value not in (supported, None, False):
            raise ValueError(f"{where}: {name}={value!r}: mp imports only {name}={supported!r}")
    out = {
        "num_moe_experts": int(args.num_experts),
        "moe_ffn_hidden_size": _arg(args, "moe_ffn_hidden_size") or settings["ffn_hidden_size"],
    }
    out |= {name: _arg(args, name, default) for name, default in MOE_COPIED.items()}
    for name, default in MOE_COPIED.items():
        if out[name] is None:
            out[name] = default
    balancing = _arg(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = _arg(args, "moe_aux_loss_coeff", 0.0)
    if isinstance(balancing, list) and len(balancing) == 1:  # Megatron's list of one
        balancing, coeff = balancing[0], coeff[0] if isinstance(coeff, list) else coeff
    losses = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
    known = losses if isinstance(balancing, list) else (*losses, "sinkhorn", "quantile_balancing")
    for kind in balancing if isinstance(balancing, list) else [balancing]:
        if kind not in known:
            raise ValueError(f"{where}: moe_router_load_balancing_type={balancing!r}: "
                             f"import-megatron takes {', '.join(known)}")  # fmt: skip
    out["moe_router_load_balancing_type"] = balancing
    out["moe_aux_loss_coeff"] = (
        [float(c) for c in coeff] if isinstance(coeff, list) else float(coeff or 0.0)
    )
    dispatcher = _arg(args, "moe_token_dispatcher_type", "allgather")
    # flex is all-to-all through another communication library: the same tokens move
    out["moe_token_dispatcher_type"] = "alltoall" if dispatcher == "flex" else dispatcher
    freq = _arg(args, "moe_layer_freq", 1)
    layers = settings["num_layers"]
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(layers)]
    if len(freq) != layers:
        raise ValueError(f"{where}: moe_layer_freq={freq!r}: {len(freq)} entries for "
                         f"{layers} layers")  # fmt: skip
    out["moe_layer_freq"] = [int(x) for x in freq]
    return out
