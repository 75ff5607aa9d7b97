"""Nemotron-H (model_type "nemotron_h", NemotronHForCausalLM: Nemotron-H, Nemotron-Nano-9B-v2,
Nemotron 3): Mamba-hybrid models, one sublayer per layer behind its own RMSNorm, as
config.json's layer types say (mp's hybrid_layer_pattern, one symbol per layer):

    "linear_attention" ("mamba")       M   a Mamba-2 mixer
    "full_attention" ("attention")     *   self-attention without positional embeddings
    "mlp"                              -   an ungated squared-ReLU MLP
    "moe"                              E   routed squared-ReLU experts beside a shared one

Hugging Face (backbone.layers.{i}.; transformers' in-memory model.layers.{i}.)
    norm.weight                    norm.weight (M), input_layernorm.weight (*),
                                   pre_mlp_layernorm.weight (-, E)
    mixer.in_proj.weight           mixer.in_proj.{z,x,B,C,dt}.weight: rows [z (I); x (I);
        [2I + 2GN + H, h]              B (G N); C (G N); dt (H)], each part viewed by group
                                       as mp's [G, rows / G, h] (the same memory order)
    mixer.conv1d.weight [I + 2GN, 1, 4] and .bias    mixer.conv1d.{x,B,C}.weight [G, rows, 4]
                                       and .bias [G, rows] (channels [x; B; C])
    mixer.dt_bias, A_log, D [H], norm.weight [I], out_proj.weight [h, I]    the same names
    mixer.{q,k,v,o}_proj.weight    self_attention.* as Llama's (llama_style.py)
    mixer.up_proj / down_proj      mlp.linear_fc1.weight / mlp.linear_fc2.weight
    mixer.gate.weight              mlp.router.weight
    mixer.gate.e_score_correction_bias    mlp.router.expert_bias
    mixer.experts.{e}.up_proj / down_proj.weight    mlp.experts.linear_fc1 / linear_fc2.weight
    mixer.shared_experts.up_proj / down_proj.weight    mlp.shared_experts.linear_fc1 / fc2
    mixer.fc1_latent_proj / fc2_latent_proj.weight    mlp.fc1_latent_proj / fc2_latent_proj.weight
                                   (a latent MoE, Nemotron 3 Super and Ultra: moe_latent_size)
backbone.embeddings.weight, backbone.norm_f.weight and lm_head.weight are
embedding.word_embeddings.weight, decoder.final_layernorm.weight and output_layer.weight.
`megatron` gives megatron-core's HybridModel names where they differ from mp's (fused
linear_qkv, in_proj and conv1d, the experts' stack, decoder.final_norm; megatron_view.py).
transformers' NemotronHForCausalLM (5.x) never ties lm_head to the embedding, whatever
tie_word_embeddings says: the import keeps lm_head.weight as a separate output layer
(untie_embeddings_and_output_weights true), and the export of a model with a tied output
layer writes the embedding again as lm_head.weight, with tie_word_embeddings false.
H Mamba heads of P channels (I = H P) in G groups (n_groups), N the state size.

Multi-token prediction (Nemotron 3 Super: num_nextn_predict_layers D modules, each of the
L layers mtp_layers_block_type lists, or, where that is absent or transformers' default
["full_attention", "moe"], the older mtp_hybrid_override_pattern string): mp's
hybrid_layer_pattern "<main>/<mtp>" with one "/<mtp>" per module (Megatron-LM's unified
pattern) and mtp_num_layers D. Hugging Face numbers the sublayers of all modules in a row
at top level: sublayer j of module k is mtp.layers.{k L + j}., holding norm.weight and mixer.*
as a decoder layer of its kind does, mp's mtp.layers.{k}.mtp_model_layer.layers.{j}.
(the family's mtp_sublayer; the same rules and transforms); besides

    mtp.layers.{k L}.enorm.weight, hnorm.weight      mtp.layers.{k}.enorm.weight, hnorm.weight
    mtp.layers.{k L}.eh_proj.weight [h, 2h]          mtp.layers.{k}.eh_proj.weight (both of
                                                         cat(enorm(e), hnorm(h)))
    mtp.layers.{k L + L - 1}.final_layernorm.weight  mtp.layers.{k}.final_layernorm.weight

transformers builds no such layer (it ignores mtp.* on load) and leaves them out when it
saves while config.json keeps counting them: weights without mtp.* tensors import as a
model without modules.

config.json -> settings: layers_block_type (or layer_types, or the older
hybrid_override_pattern string) -> hybrid_layer_pattern; mamba_num_heads, mamba_head_dim,
n_groups, ssm_state_size -> mamba_num_heads, mamba_head_dim, mamba_num_groups,
mamba_state_dim; head_dim -> kv_channels (transformers' default 128 when absent);
layer_norm_epsilon (the mixers' gated norms' too) -> layernorm_epsilon; intermediate_size
-> ffn_hidden_size; position_embedding_type "none" (NemotronHAttention rotates nothing);
chunk_size -> mamba_chunk_size, a setting mp keeps only to write it back (mp's scan is exact
whatever the chunk). The routing of E layers (Nemotron 3), as DeepSeek-V3's
(deepseek_v3.py): sigmoid scores, the experts chosen by score + e_score_correction_bias
(moe_router_enable_expert_bias), within topk_group of n_group groups, weights normalized
when more than one expert is chosen (norm_topk_prob must say so), times
routed_scaling_factor (moe_router_topk_scaling_factor); the router in fp32; one shared
expert of moe_shared_expert_intermediate_size (transformers builds one whatever
n_shared_experts says; the export writes 1). No load-balancing loss is read (config.json
names none): moe_router_load_balancing_type "none".

The time step. transformers (5.x) clamps softplus(dt + dt_bias) to at least time_step_min
(default 0.001) in its chunked scan (its torch path and the mamba_ssm kernel), not in its
one-token recurrence; Megatron's mixer and mp's do not clamp. The two agree unless
dt + dt_bias falls below softplus^-1(time_step_min) (about -6.9 for 0.001), so
time_step_min is accepted (and, like time_step_max and time_step_floor, which only
initialize dt_bias, written back as transformers' defaults, which mp's initialization also
uses); time_step_limit, a clamp of the older remote code, must be (0, inf).

Refused (with the key and value): mamba_hidden_act other than silu, mlp_hidden_act other
than relu2, use_conv_bias false (mp's mixer always has a convolution bias), conv_kernel
other than 4, use_bias / mamba_proj_bias / mlp_bias / attention_bias true (mp's
add_bias_linear would give attention biases transformers' attention never has),
sliding_window, a time_step_limit other than (0, inf), and group-limited routing whose
groups mp would rank otherwise (num_experts_per_tok // topk_group other than 2).
residual_in_fp32 (unused by transformers' model), rescale_prenorm_residual (initialization
only), expand (unused with mamba_num_heads), use_mamba_kernels and the cache settings are
read as nothing and written as transformers' defaults.
"""

from __future__ import annotations

import re

from mp_ckpt.families.hf_settings import LLAMA_STYLE, check_computes, refuse, token_ids
from mp_ckpt.families.mamba_rules import check_time_step_limit, mamba_rules
from mp_ckpt.families.moe_settings import check_group_rank, positive, sigmoid_routing
from mp_ckpt.families.table import (
    Dims,
    Family,
    Rule,
    heads_flat,
    kv_heads,
    q_heads,
    split_hybrid_pattern,
)

__all__ = ["FAMILY"]

_DEFAULTS = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 4096, "intermediate_size": 21504, "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "chunk_size": 128,
    "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688, "routed_scaling_factor": 1.0, "n_group": 1,
    "topk_group": 1,
}  # fmt: skip
"""transformers' NemotronHConfig defaults, for a key config.json omits."""

_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
           "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}  # fmt: skip
"""Older config.json keys transformers still reads, and their current names."""

_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
            "mlp": "-", "moe": "E"}  # fmt: skip
_LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_MTP_DEFAULT = "*E"
"""transformers' mtp_layers_block_type when config.json names none."""

# --- rules -------------------------------------------------------------------------------


def _untied(settings: dict) -> bool:
    return bool(settings.get("untie_embeddings_and_output_weights"))


def _tied(settings: dict) -> bool:
    return not _untied(settings)


def _latent(settings: dict) -> bool:
    return settings.get("moe_latent_size") is not None


_L = "backbone.layers.{i}."
_M = _L + "mixer."
_MTP = "mtp.layers.{i}."
RULES = (
    Rule(("embedding.word_embeddings.weight",), "backbone.embeddings.weight", "model"),
    Rule(("decoder.final_layernorm.weight",), "backbone.norm_f.weight", "model",
         megatron="decoder.final_norm"),
    Rule(("output_layer.weight",), "lm_head.weight", "model", when=_untied),
    Rule(("embedding.word_embeddings.weight",), "lm_head.weight", "model", when=_tied,
         model_copy=True),
    # M: the Mamba mixer
    *mamba_rules(_M, _L + "norm.weight"),
    # *: attention
    Rule(("input_layernorm.weight",), _L + "norm.weight", "attention"),
    Rule(("self_attention.linear_qkv.q.weight",), _M + "q_proj.weight", "attention",
         to_mp=q_heads, to_hf=heads_flat, megatron="self_attention.linear_qkv"),
    *(Rule((f"self_attention.linear_qkv.{p}.weight",), f"{_M}{p}_proj.weight", "attention",
           to_mp=kv_heads, to_hf=heads_flat, megatron="self_attention.linear_qkv")
      for p in "kv"),
    Rule(("self_attention.linear_proj.weight",), _M + "o_proj.weight", "attention"),
    # -: a dense MLP
    Rule(("pre_mlp_layernorm.weight",), _L + "norm.weight", "dense"),
    Rule(("mlp.linear_fc1.weight",), _M + "up_proj.weight", "dense"),
    Rule(("mlp.linear_fc2.weight",), _M + "down_proj.weight", "dense"),
    # E: experts
    Rule(("pre_mlp_layernorm.weight",), _L + "norm.weight", "moe"),
    Rule(("mlp.router.weight",), _M + "gate.weight", "moe"),
    Rule(("mlp.router.expert_bias",), _M + "gate.e_score_correction_bias", "moe",
         keep_dtype=True),
    Rule(("mlp.experts.linear_fc1.weight",), _M + "experts.{e}.up_proj.weight", "moe",
         megatron="mlp.experts.experts.linear_fc1"),
    Rule(("mlp.experts.linear_fc2.weight",), _M + "experts.{e}.down_proj.weight", "moe",
         megatron="mlp.experts.experts.linear_fc2"),
    Rule(("mlp.shared_experts.linear_fc1.weight",), _M + "shared_experts.up_proj.weight", "moe"),
    Rule(("mlp.shared_experts.linear_fc2.weight",), _M + "shared_experts.down_proj.weight",
         "moe"),
    *(Rule((f"mlp.{n}.weight",), f"{_M}{n}.weight", "moe", when=_latent)
      for n in ("fc1_latent_proj", "fc2_latent_proj")),
    # a multi-token prediction module's own (its sublayers take the rules above)
    *(Rule((f"{n}.weight",), f"{_MTP}{n}.weight", "mtp") for n in ("enorm", "hnorm", "eh_proj")),
    Rule(("final_layernorm.weight",), _MTP + "final_layernorm.weight", "mtp_last"),
)  # fmt: skip

_IN_MEMORY = re.compile(r"^model\.(.*)$")
_FUSED_EXPERTS = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts\.)(up_proj|down_proj)$")


def _prepare(state: dict, config: dict) -> dict:
    """transformers' in-memory names (model.*, each layer's experts fused as
    mixer.experts.up_proj [E, F, h] and down_proj [E, h, F]) -> its saved ones."""
    out = {}
    for name, tensor in state.items():
        match = _IN_MEMORY.match(name)
        name = f"backbone.{match.group(1)}" if match else name
        fused = _FUSED_EXPERTS.match(name)
        if fused is None:
            out[name] = tensor
            continue
        for e, one in enumerate(tensor.unbind(0)):
            out[f"{fused.group(1)}{e}.{fused.group(2)}.weight"] = one
    return out


# --- config.json -> settings -------------------------------------------------------------


def _current(config: dict) -> dict:
    """config.json with its older keys under their current names (transformers' reading)."""
    renamed = {_LEGACY[k]: v for k, v in config.items() if k in _LEGACY}
    return {k: v for k, v in config.items() if k not in _LEGACY} | renamed


def _pattern(config: dict) -> str:
    """The decoder's part of hybrid_layer_pattern: of layers_block_type (or layer_types,
    current or older names) or of the older hybrid_override_pattern string."""
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is not None:
        return _symbols(kinds, "layers_block_type")
    pattern = config.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("config.json names no layer types (layers_block_type, layer_types "
                         "or hybrid_override_pattern)")  # fmt: skip
    return _symbols([_LAYER_TYPES.get(symbol, symbol) for symbol in pattern], "layers_block_type")


def _mtp_pattern(config: dict) -> str:
    """One multi-token prediction module's layers, as transformers reads them:
    mtp_layers_block_type, unless it is absent or its default and the older
    mtp_hybrid_override_pattern string says otherwise."""
    kinds = config.get("mtp_layers_block_type")
    pattern = _MTP_DEFAULT if kinds is None else _symbols(kinds, "mtp_layers_block_type")
    older = config.get("mtp_hybrid_override_pattern")
    if older is None or pattern != _MTP_DEFAULT:
        return pattern
    if not isinstance(older, str):
        raise ValueError(f"config.json mtp_hybrid_override_pattern={older!r}: expected a "
                         "string of layer symbols (M, *, -, E)")  # fmt: skip
    return _symbols([_LAYER_TYPES.get(s, s) for s in older], "mtp_hybrid_override_pattern")


def _symbols(kinds, key: str) -> str:
    """The pattern of a list of layer type names (config.json's `key`)."""
    unknown = sorted({str(k) for k in kinds} - set(_SYMBOLS)) if isinstance(kinds, list) else []
    if not isinstance(kinds, list) or not kinds or unknown:
        raise ValueError(
            f"config.json {key}={kinds!r}: mp converts the layer types "
            f"{', '.join(sorted(_SYMBOLS))}" + (f", not {', '.join(unknown)}" if unknown else "")
        )
    return "".join(_SYMBOLS[k] for k in kinds)


def _settings(config: dict) -> dict:
    config = _current(config)
    for key, supported in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2"),
                           ("use_conv_bias", True), ("conv_kernel", 4), ("use_bias", False),
                           ("mamba_proj_bias", False), ("mlp_bias", False),
                           ("attention_bias", False), ("sliding_window", None)):  # fmt: skip
        refuse(config, key, supported)
    depths = config.get("num_nextn_predict_layers") or 0
    if not isinstance(depths, int) or depths < 0:
        raise ValueError(f"config.json num_nextn_predict_layers={depths!r}: expected a "
                         "number of multi-token prediction modules (0 or more)")  # fmt: skip
    check_time_step_limit(config)
    main = _pattern(config)
    pattern = main + (f"/{_mtp_pattern(config)}" * depths if depths else "")
    heads = positive(config, "num_attention_heads", _DEFAULTS)
    hidden = positive(config, "hidden_size", _DEFAULTS)
    settings = {
        "num_layers": len(main), "hybrid_layer_pattern": pattern, "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "kv_channels": positive(config, "head_dim", _DEFAULTS),
        "ffn_hidden_size": positive(config, "intermediate_size", _DEFAULTS),
        "normalization": "RMSNorm", "activation": "squared_relu",
        "position_embedding_type": "none",
        "layernorm_epsilon": config.get("layer_norm_epsilon", _DEFAULTS["layer_norm_epsilon"]),
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
        "hidden_dropout": config.get("hidden_dropout", 0.0),
        "attention_dropout": config.get("attention_dropout", 0.0),
        "init_method_std": config.get("initializer_range", _DEFAULTS["initializer_range"]),
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": positive(config, "max_position_embeddings", _DEFAULTS),
        "mamba_num_heads": positive(config, "mamba_num_heads", _DEFAULTS),
        "mamba_head_dim": positive(config, "mamba_head_dim", _DEFAULTS),
        "mamba_num_groups": positive(config, "n_groups", _DEFAULTS),
        "mamba_state_dim": positive(config, "ssm_state_size", _DEFAULTS),
        "mamba_chunk_size": positive(config, "chunk_size", _DEFAULTS),
    }  # fmt: skip
    if depths:
        settings["mtp_num_layers"] = depths
    return settings | (_routing(config) if "E" in pattern else {})


def _held(config: dict, names) -> dict:
    """num_nextn_predict_layers 0 for weights without multi-token prediction tensors, as
    transformers saves a model whose config.json counts them (module docstring)."""
    if config.get("num_nextn_predict_layers") and not any(n.startswith("mtp.") for n in names):
        return config | {"num_nextn_predict_layers": 0}
    return config


def _routing(config: dict) -> dict:
    """The experts and their routing (module docstring)."""
    experts = positive(config, "n_routed_experts", _DEFAULTS)
    topk = positive(config, "num_experts_per_tok", _DEFAULTS)
    if topk > experts:
        raise ValueError(
            f"config.json num_experts_per_tok={topk}: more than n_routed_experts={experts}"
        )
    limited = sigmoid_routing(config, experts, topk, _DEFAULTS, "Nemotron-H")
    return limited | {
        "num_moe_experts": experts, "moe_router_topk": topk,
        "moe_ffn_hidden_size": positive(config, "moe_intermediate_size", _DEFAULTS),
        "moe_shared_expert_intermediate_size":
            positive(config, "moe_shared_expert_intermediate_size", _DEFAULTS),
        "moe_shared_expert_gate": False, "moe_layer_freq": [1],
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False, "moe_router_dtype": "fp32",
        "moe_router_topk_scaling_factor":
            float(config.get("routed_scaling_factor", _DEFAULTS["routed_scaling_factor"])),
        "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None, "moe_latent_size": config.get("moe_latent_size"),
    }  # fmt: skip


# --- settings -> config.json -------------------------------------------------------------

# A latent MoE (moe_latent_size) is Nemotron 3's own: the one family that writes it.
_COMPUTES = {k: v for k, v in LLAMA_STYLE.items() if k != "moe_latent_size"} | {
    "activation": "squared_relu", "position_embedding_type": "none", "add_bias_linear": False,
    "add_qkv_bias": False, "multi_latent_attention": False,
    "moe_shared_expert_gate": False, "moe_expert_capacity_factor": None,
}  # fmt: skip
_MOE_COMPUTES = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
_MOE_KEYS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_group",
    "topk_group",
    "moe_shared_expert_intermediate_size",
    "routed_scaling_factor",
)


def _moe_config(settings: dict, shapes: dict) -> dict:
    """The experts' keys: the model's, or transformers' defaults without E layers."""
    if "E" not in settings["hybrid_layer_pattern"]:
        return {k: _DEFAULTS[k] for k in _MOE_KEYS} | {"norm_topk_prob": True}
    check_computes(settings, "nemotron_h", _MOE_COMPUTES)
    groups, kept = check_group_rank(settings, "Nemotron-H")
    topk = settings["moe_router_topk"]
    shared = shapes.get("shared_ffn")
    if not shared:
        raise ValueError("the nemotron_h export needs a shared expert in each E layer")
    return {
        "n_routed_experts": shapes["experts"], "num_experts_per_tok": topk,
        "moe_intermediate_size": shapes["expert_ffn"],
        "moe_shared_expert_intermediate_size": shared, "n_group": groups, "topk_group": kept,
        "routed_scaling_factor": float(settings.get("moe_router_topk_scaling_factor") or 1.0),
        "norm_topk_prob": topk > 1,
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    check_computes(settings, "nemotron_h", _COMPUTES)
    pattern = settings["hybrid_layer_pattern"]
    main, module, depths = split_hybrid_pattern(pattern)
    if (settings.get("mtp_num_layers") or 0) != depths:
        raise ValueError(f"model_config mtp_num_layers={settings.get('mtp_num_layers')!r} with "
                         f"hybrid_layer_pattern={pattern!r} of {depths} multi-token prediction "
                         "modules")  # fmt: skip
    dims = Dims.of(settings | {"hybrid_layer_pattern": "M"})  # the widths, Mamba layers or not
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": shapes["vocab"], "hidden_size": shapes["hidden"],
        "layers_block_type": [_LAYER_TYPES[symbol] for symbol in main],
        "tie_word_embeddings": False, "use_cache": True, "num_logits_to_keep": 1,
        **token_ids(tokens),
        "num_attention_heads": shapes["heads"], "num_key_value_heads": shapes["groups"],
        "head_dim": shapes["head_dim"],
        "max_position_embeddings": settings.get("max_position_embeddings",
                                                settings.get("seq_length", 4096)),
        "attention_bias": False, "attention_dropout": settings.get("attention_dropout", 0.0),
        "sliding_window": None,
        "intermediate_size": shapes.get("ffn") or settings.get("ffn_hidden_size")
        or _DEFAULTS["intermediate_size"],
        "mlp_hidden_act": "relu2", "mlp_bias": False, "use_mamba_kernels": True,
        "ssm_state_size": dims.mamba_state, "mamba_num_heads": dims.mamba_heads,
        "mamba_head_dim": dims.mamba_head_dim, "mamba_hidden_act": "silu",
        "n_groups": dims.mamba_groups, "conv_kernel": 4, "expand": 2,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_limit": [0.0, float("inf")],
        "time_step_floor": 1e-4, "use_conv_bias": True,
        "chunk_size": settings.get("mamba_chunk_size") or _DEFAULTS["chunk_size"],
        "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
        "output_router_logits": False, "n_shared_experts": 1,
        "moe_latent_size": settings.get("moe_latent_size"),
        "moe_shared_expert_overlap": True, **_moe_config(settings, shapes),
        "num_nextn_predict_layers": depths,
        "mtp_layers_block_type": [_LAYER_TYPES[symbol] for symbol in module or _MTP_DEFAULT],
        "use_bias": False, "initializer_range": settings.get("init_method_std", 0.02),
        "layer_norm_epsilon": settings.get("layernorm_epsilon", 1e-5),
        "residual_in_fp32": False, "hidden_dropout": settings.get("hidden_dropout", 0.0),
        "rescale_prenorm_residual": True, "dtype": dtype,
    }  # fmt: skip


FAMILY = Family("nemotron_h", "NemotronHForCausalLM", RULES, _settings, _config,
                prepare=_prepare, held=_held, mtp_sublayer=(_L, _MTP))  # fmt: skip
