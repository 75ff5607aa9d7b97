"""Mixtral's and Qwen2-MoE's config.json <-> a model's settings under Megatron's names.

    mixtral_settings(config), qwen2_moe_settings(config)    config.json -> settings
    mixtral_config(...), qwen2_moe_config(...)              settings -> config.json

Attention, norms and rotary embeddings are Llama's (hf_config.llama_settings, with
each model's own defaults); what follows is the mixture of experts.

Routing. Both score the experts with a softmax over all of them and keep the top k.
Mixtral then divides the k kept probabilities by their sum, which equals a softmax
over the k largest logits: moe_router_pre_softmax=False. Qwen2-MoE renormalizes only
with norm_topk_prob=True; with False (its default) the kept weights are the full
softmax's: moe_router_pre_softmax=True. Both train with the Switch load-balancing
loss over the batch (moe_router_load_balancing_type="aux_loss", router_aux_loss_coef
-> moe_aux_loss_coeff).

Layers. Every Mixtral layer is a mixture of experts (moe_layer_freq=[1]). Qwen2-MoE
layer i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
== 0; the others are a dense SwiGLU MLP of intermediate_size. mp keeps the pattern as
moe_layer_freq, a 0/1 list per layer. Every sparse Qwen2-MoE layer also has a shared
expert (shared_expert_intermediate_size) whose output is scaled by
sigmoid(x @ shared_expert_gate.T): moe_shared_expert_gate=True.

The export writes the keys transformers 5 writes for these models (rope_parameters,
dtype). Qwen2-MoE's sliding-window keys have no effect while use_sliding_window is
false; they are written as transformers writes them then (sliding_window 0,
max_window_layers 28, layer_types all "full_attention").
"""

from __future__ import annotations

from mp_ckpt.hf_config import llama_settings, rope_scaling, token_ids

__all__ = [
    "ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "mixtral_config",
    "mixtral_settings",
    "moe_topk",
    "qwen2_moe_config",
    "qwen2_moe_settings",
    "qwen2_moe_sparse_layers",
]

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe")
ARCHITECTURES = ("gpt2", "llama", *MOE_ARCHITECTURES)
"""Every architecture export_hf writes; here, without torch, for `mp-ckpt --help`."""

# Keys config.json may omit, at the values transformers' config classes give them.
_MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336}
_QWEN2_MOE_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                       "shared_expert_intermediate_size": 5632, "intermediate_size": 5632,
                       "decoder_sparse_step": 1}  # fmt: skip
_QWEN2_MOE_MAX_WINDOW_LAYERS = 28  # transformers' default; unused without a sliding window


def _get(config: dict, key: str, defaults: dict):
    value = config.get(key)
    return defaults[key] if value is None else value


def _positive(config: dict, key: str, defaults: dict) -> int:
    value = _get(config, key, defaults)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def _routing(config: dict, experts_key: str, defaults: dict) -> dict:
    experts = _positive(config, experts_key, defaults)
    topk = _positive(config, "num_experts_per_tok", defaults)
    if topk > experts:
        raise ValueError(
            f"config.json num_experts_per_tok={topk}: more than {experts_key}={experts}"
        )
    return {
        "num_moe_experts": experts, "moe_router_topk": topk,
        "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.001),
        "moe_z_loss_coeff": None,
    }  # fmt: skip


def mixtral_settings(config: dict) -> dict:
    """The settings of a Mixtral config.json (model_type "mixtral")."""
    if config.get("sliding_window") is not None:
        raise ValueError(
            f"config.json sliding_window={config['sliding_window']!r}: mp attends to every "
            "earlier position; only sliding_window=null is computed"
        )
    if config.get("router_jitter_noise"):
        raise ValueError(
            f"config.json router_jitter_noise={config['router_jitter_noise']!r}: mp's router "
            "computes only router_jitter_noise=0.0"
        )
    ffn = _positive(config, "intermediate_size", _MIXTRAL_DEFAULTS)
    base = llama_settings(config | {"intermediate_size": ffn}, rope_theta=1e6,
                          rms_norm_eps=1e-5, max_positions=4096 * 32)  # fmt: skip
    return base | _routing(config, "num_local_experts", _MIXTRAL_DEFAULTS) | {
        "moe_ffn_hidden_size": ffn, "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
        "moe_layer_freq": [1],
    }  # fmt: skip


def qwen2_moe_sparse_layers(config: dict) -> list[int]:
    """moe_layer_freq of a Qwen2-MoE config.json: 1 for a sparse layer, 0 for a dense one."""
    step = _positive(config, "decoder_sparse_step", _QWEN2_MOE_DEFAULTS)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"config.json mlp_only_layers={dense!r}: expected a list of layer indices")
    layers = config["num_hidden_layers"]
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise ValueError(
            f"config.json decoder_sparse_step={step} with mlp_only_layers={dense!r}: none of "
            f"the num_hidden_layers={layers} layers is sparse"
        )
    return pattern


def qwen2_moe_settings(config: dict) -> dict:
    """The settings of a Qwen2-MoE config.json (model_type "qwen2_moe")."""
    if config.get("use_sliding_window"):
        raise ValueError(
            "config.json use_sliding_window=True: mp attends to every earlier position; "
            "only use_sliding_window=false is computed"
        )
    kinds = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        raise ValueError(
            f"config.json layer_types={kinds!r}: mp computes only 'full_attention' layers"
        )
    if config.get("norm_topk_prob", False) not in (True, False):
        raise ValueError(
            f"config.json norm_topk_prob={config['norm_topk_prob']!r}: expected true or false"
        )
    ffn = _positive(config, "intermediate_size", _QWEN2_MOE_DEFAULTS)
    base = llama_settings(config | {"intermediate_size": ffn}, rope_theta=10000.0,
                          rms_norm_eps=1e-6, max_positions=32768)  # fmt: skip
    return base | _routing(config, "num_experts", _QWEN2_MOE_DEFAULTS) | {
        "add_qkv_bias": bool(config.get("qkv_bias", True)),
        "moe_ffn_hidden_size": _positive(config, "moe_intermediate_size", _QWEN2_MOE_DEFAULTS),
        "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        "moe_shared_expert_intermediate_size": _positive(
            config, "shared_expert_intermediate_size", _QWEN2_MOE_DEFAULTS),
        "moe_shared_expert_gate": True,
        "moe_layer_freq": qwen2_moe_sparse_layers(config),
    }  # fmt: skip


# --- export ------------------------------------------------------------------------------


def _check_routing(settings: dict, arch: str, pre_softmax: bool | None) -> int:
    topk = settings.get("moe_router_topk")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"model_config moe_router_topk={topk!r}: the {arch} export needs it")
    # transformers' experts take every routed token (no capacity) and route on the scores
    # alone (no expert bias)
    checks = [
        ("moe_router_score_function", "softmax"),
        ("moe_router_topk_scaling_factor", None),
        ("moe_expert_capacity_factor", None),
        ("moe_router_enable_expert_bias", False),
    ]
    if pre_softmax is not None:
        checks.append(("moe_router_pre_softmax", pre_softmax))
    for field, supported in checks:
        value = settings.get(field, supported)
        if value != supported and not (field == "moe_router_topk_scaling_factor" and value == 1.0):
            raise ValueError(
                f"model_config {field}={value!r}: {arch} computes only {field}={supported!r}"
            )
    return topk


def _aux_loss_coef(settings: dict) -> float:
    if settings.get("moe_router_load_balancing_type", "aux_loss") == "none":
        return 0.0
    return settings.get("moe_aux_loss_coeff", 0.0)


def _rope_parameters(settings: dict) -> dict:
    theta, scaling = rope_scaling(settings)
    return {"rope_theta": theta, **(scaling or {"rope_type": "default"})}


def _common(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    """The keys every Llama-style config.json of transformers 5 has."""
    return {
        "vocab_size": shapes["vocab"], "hidden_size": shapes["hidden"],
        "num_hidden_layers": shapes["layers"], "num_attention_heads": shapes["heads"],
        "num_key_value_heads": shapes["groups"], "hidden_act": "silu",
        "max_position_embeddings": settings.get("max_position_embeddings",
                                                settings.get("seq_length", 2048)),
        "rms_norm_eps": settings.get("layernorm_epsilon", 1e-5),
        "rope_parameters": _rope_parameters(settings),
        "attention_dropout": settings.get("attention_dropout", 0.0),
        "initializer_range": settings.get("init_method_std", 0.02),
        "tie_word_embeddings": shapes["tied"], "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": _aux_loss_coef(settings),
        "num_experts_per_tok": shapes["topk"], **token_ids(tokens), "dtype": dtype,
    }  # fmt: skip


def mixtral_config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    """MixtralForCausalLM's config.json. shapes: vocab, hidden, layers, heads, groups,
    head_dim, experts, expert_ffn, tied, topk (moe_topk)."""
    return _common(settings, shapes, tokens, dtype) | {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "head_dim": shapes["head_dim"], "intermediate_size": shapes["expert_ffn"],
        "num_local_experts": shapes["experts"], "router_jitter_noise": 0.0,
        "sliding_window": None,
    }  # fmt: skip


def qwen2_moe_config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    """Qwen2MoeForCausalLM's config.json. shapes: as mixtral_config's, and ffn (the dense
    layers' width), shared_ffn, sparse (0/1 per layer) and qkv_bias."""
    step, dense = _sparse_step(shapes["sparse"])
    config = _common(settings, shapes, tokens, dtype) | {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "intermediate_size": shapes["ffn"], "moe_intermediate_size": shapes["expert_ffn"],
        "shared_expert_intermediate_size": shapes["shared_ffn"],
        "num_experts": shapes["experts"], "decoder_sparse_step": step, "mlp_only_layers": dense,
        "norm_topk_prob": not settings.get("moe_router_pre_softmax", False),
        "qkv_bias": shapes["qkv_bias"], "use_sliding_window": False, "sliding_window": 0,
        "max_window_layers": _QWEN2_MOE_MAX_WINDOW_LAYERS,
        "layer_types": ["full_attention"] * shapes["layers"],
    }  # fmt: skip
    if shapes["head_dim"] * shapes["heads"] != shapes["hidden"]:
        config["head_dim"] = shapes["head_dim"]  # Qwen2-MoE reads it where present
    return config


def _sparse_step(sparse: list[int]) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) giving exactly the sparse layers `sparse`:
    the step that leaves the fewest layers to list (then the smallest step)."""
    best = None
    for step in range(1, len(sparse) + 1):
        by_step = [(i + 1) % step == 0 for i in range(len(sparse))]
        if any(s and not b for s, b in zip(sparse, by_step, strict=True)):
            continue  # a sparse layer this step would make dense
        dense = [i for i, (s, b) in enumerate(zip(sparse, by_step, strict=True)) if b and not s]
        if best is None or len(dense) < len(best[1]):
            best = (step, dense)
    assert best is not None  # step 1 marks every layer sparse
    return best


def moe_topk(settings: dict, arch: str) -> int:
    """The router's top k, after refusing a routing `arch` does not compute (Mixtral
    always renormalizes; Qwen2-MoE's norm_topk_prob says either)."""
    return _check_routing(settings, arch, False if arch == "mixtral" else None)
