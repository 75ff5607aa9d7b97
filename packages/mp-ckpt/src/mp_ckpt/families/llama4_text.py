"""Llama 4's text model (model_type "llama4_text", Llama4ForCausalLM; Scout, Maverick):
Llama's attention without q/k/v biases, rotary embeddings on channel pairs (2i, 2i + 1)
(Meta's complex rotation: rotary_interleaved, so the q/k rows are imported as they
are), skipped on the NoPE layers, mixture-of-experts layers with a shared expert.

Hugging Face (model.layers.{i}.)                 mp (decoder.layers.{i}.)
    self_attn.{q,k,v,o}_proj.weight, input_layernorm.weight,
    post_attention_layernorm.weight             as llama_style's
    feed_forward.{gate,up,down}_proj.weight     mlp.linear_fc1.{gate,up}.weight,
                                                mlp.linear_fc2.weight (dense layers)
    feed_forward.router.weight [E, h]           mlp.router.weight
    feed_forward.experts.gate_up_proj [E, h, 2F]  mlp.experts.linear_fc1.{gate,up}.weight
                                                [E, F, h]: the first F columns the gate,
                                                the last F the up projection, transposed
    feed_forward.experts.down_proj [E, F, h]    mlp.experts.linear_fc2.weight [E, h, F]
    feed_forward.shared_expert.{gate,up,down}_proj.weight
                                                mlp.shared_experts.linear_fc1.{gate,up}
                                                .weight, .linear_fc2.weight

Settings. no_rope_layers (1: the layer rotates; from no_rope_layer_interval when absent)
is mp's no_rope_freq the other way round (1: no rotary embeddings). use_qk_norm
divides each rotating layer's query and key heads by sqrt(mean(x^2) + rms_norm_eps),
without weights: qk_l2_norm with qk_l2_norm_layers "rope". The layers moe_layers names
(from interleave_moe_layer_step when absent) have experts of intermediate_size beside a
shared expert as wide; the others a dense MLP of intermediate_size_mlp. The router
takes the top logit and weighs the token by its sigmoid (moe_router_score_function
"sigmoid", one expert), multiplying the expert's input (moe_apply_probs_on_input):
num_experts_per_tok must be 1, as in the released models (and in Megatron).

Chunked attention on the rotating layers (attention_chunk_size) and the NoPE layers'
query scale 1 + attn_scale ln(1 + floor((p + 1) / floor_scale)) at position p
(attn_temperature_tuning) are mp-layers' attention_chunk_size,
attn_temperature_floor_scale and attn_temperature_scale, so the import is exact at
every length. Megatron-LM has neither (its Llama 4 equals this one on sequences of up to
min(attention_chunk_size, floor_scale - 1) tokens, 8191 with Llama 4's values): the
Megatron writer refuses them. transformers' Llama 4 always builds the chunked mask, so
the export of settings without a chunk writes max_position_embeddings as the chunk (no
sequence the model takes is cut), and attn_temperature_tuning false without a floor.
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import LLAMA_STYLE, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import shared_expert_rules
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.nope import interval_of, rotating_layers, rotating_of
from mp_ckpt.families.table import Dims, Family, Rule

__all__ = ["FAMILY"]

_DEFAULTS = {"num_local_experts": 16, "num_experts_per_tok": 1, "intermediate_size": 8192,
             "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1,
             "no_rope_layer_interval": 4}  # fmt: skip
_LONG_CONTEXT = {"attention_chunk_size": 8192, "attn_temperature_tuning": True,
                 "floor_scale": 8192, "attn_scale": 0.1}  # fmt: skip
"""Llama 4's chunked attention and temperature tuning where config.json leaves them out."""
_FF = "model.layers.{i}.feed_forward."
_FC1 = ("mlp.experts.linear_fc1.gate.weight", "mlp.experts.linear_fc1.up.weight")


def _split(t, dims: Dims) -> list[torch.Tensor]:
    """gate_up_proj [E, h, 2F] -> gate, up [E, F, h]."""
    gate, up = t[0].chunk(2, dim=2)
    return [gate.transpose(1, 2).contiguous(), up.transpose(1, 2).contiguous()]


def _join(t, dims: Dims) -> list[torch.Tensor]:
    return [torch.cat([t[0], t[1]], dim=1).transpose(1, 2).contiguous()]


def _swap(t, dims: Dims) -> list[torch.Tensor]:
    return [t[0].transpose(1, 2).contiguous()]


RULES = (
    *model_rules(),
    *attention_rules(),
    *norm_rules(),
    *dense_mlp_rules(block="feed_forward"),
    Rule(("mlp.router.weight",), _FF + "router.weight", "moe"),
    Rule(_FC1, _FF + "experts.gate_up_proj", "moe", to_mp=_split, to_hf=_join,
         megatron="mlp.experts.experts.linear_fc1"),
    Rule(("mlp.experts.linear_fc2.weight",), _FF + "experts.down_proj", "moe", to_mp=_swap,
         to_hf=_swap, megatron="mlp.experts.experts.linear_fc2"),
    *shared_expert_rules(gated=False, block="feed_forward"),
)  # fmt: skip


def _sparse(config: dict, layers: int) -> list[int]:
    """moe_layer_freq (1: experts) of moe_layers, as transformers completes it."""
    chosen = config.get("moe_layers")
    if chosen is None:
        step = positive(config, "interleave_moe_layer_step", _DEFAULTS)
        chosen = range(step - 1, layers, step)
    elif not isinstance(chosen, list) or not all(isinstance(i, int) for i in chosen):
        raise ValueError(f"config.json moe_layers={chosen!r}: expected a list of layer indices")
    pattern = [int(i in chosen) for i in range(layers)]
    if not any(pattern):
        raise ValueError(
            f"config.json moe_layers={config.get('moe_layers')!r}, interleave_moe_layer_step="
            f"{config.get('interleave_moe_layer_step')!r}: none of the {layers} layers has experts"
        )
    return pattern


def _settings(config: dict) -> dict:
    topk = positive(config, "num_experts_per_tok", _DEFAULTS)
    if topk != 1:
        raise ValueError(
            f"config.json num_experts_per_tok={topk}: Llama 4 scales each expert's input by "
            "its routing weight, which mp computes for one expert per token only "
            "(moe_apply_probs_on_input needs moe_router_topk 1)"
        )
    layers = config["num_hidden_layers"]
    rotating = rotating_layers(config, layers, _DEFAULTS["no_rope_layer_interval"])
    kinds = ["chunked_attention" if r else "full_attention" for r in rotating]
    if config.get("layer_types") is not None and config["layer_types"] != kinds:
        raise ValueError(
            f"config.json layer_types={config['layer_types']!r}: mp reads Llama 4's own, "
            f"chunked attention where a layer rotates ({kinds!r})"
        )
    # Llama 4's defaults where config.json leaves a key out (head_dim: 128, not h / heads)
    plain = {"num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048} | config
    plain["intermediate_size"] = positive(config, "intermediate_size_mlp", _DEFAULTS)
    base = llama_settings(plain, rope_theta=500000.0, rms_norm_eps=1e-5, max_positions=131072)
    long = _LONG_CONTEXT | {k: v for k, v in config.items() if k in _LONG_CONTEXT}
    chunk = long["attention_chunk_size"] if any(rotating) else None  # chunks rotating layers
    if chunk is not None:
        chunk = positive(long, "attention_chunk_size", {})
    tuned = long["attn_temperature_tuning"] and long["attn_scale"] and not all(rotating)
    qk_norm = bool(config.get("use_qk_norm", True)) and any(rotating)
    width = positive(config, "intermediate_size", _DEFAULTS)
    return base | routing(config, "num_local_experts", _DEFAULTS) | {
        "rotary_interleaved": True,
        "no_rope_freq": None if all(rotating) else [1 - r for r in rotating],
        "qk_l2_norm": qk_norm, "qk_l2_norm_layers": "rope" if qk_norm else "all",
        "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
        "moe_apply_probs_on_input": True, "moe_ffn_hidden_size": width,
        "moe_shared_expert_intermediate_size": width, "moe_shared_expert_gate": False,
        "moe_layer_freq": _sparse(config, layers), "attention_chunk_size": chunk,
        "attn_temperature_floor_scale": positive(long, "floor_scale", {}) if tuned else None,
        "attn_temperature_scale": float(long["attn_scale"]) if tuned else 0.1,
    }  # fmt: skip


# --- export ------------------------------------------------------------------------------


def _qk_norm(settings: dict, rotating: list[int]) -> bool:
    if not settings.get("qk_l2_norm"):
        return False
    if settings.get("qk_l2_norm_layers", "all") != "rope" and not all(rotating):
        raise ValueError(
            "model_config qk_l2_norm_layers='all' with layers without rotary embeddings "
            "(no_rope_freq): Llama 4 normalizes the rotating layers' queries and keys only"
        )
    return True


_LONG_CONTEXT_FIELDS = ("attention_chunk_size", "attn_temperature_floor_scale",
                        "attn_temperature_scale")  # fmt: skip


def _long_context(settings: dict, max_positions: int) -> dict:
    """config.json's chunked attention and temperature tuning of the settings' (module
    docstring: the chunk max_positions and no tuning where they have none)."""
    floor = settings.get("attn_temperature_floor_scale")
    return {
        "attention_chunk_size": settings.get("attention_chunk_size") or max_positions,
        "attn_temperature_tuning": floor is not None,
        "floor_scale": floor or _LONG_CONTEXT["floor_scale"],
        "attn_scale": settings.get("attn_temperature_scale", 0.1) if floor else 0.1,
    }


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers, sparse = shapes["layers"], shapes["sparse"]
    if shapes.get("shared_ffn") != shapes["expert_ffn"]:
        raise ValueError(
            f"model_config moe_shared_expert_intermediate_size={shapes.get('shared_ffn')!r}: "
            f"Llama 4's shared expert is as wide as its experts ({shapes['expert_ffn']})"
        )
    rotating = rotating_of(settings, layers)
    qk_norm = _qk_norm(settings, rotating)
    computes = {"rotary_interleaved": True, "no_rope_freq": settings.get("no_rope_freq"),
                "qk_l2_norm": qk_norm, "moe_apply_probs_on_input": True, "moe_router_topk": 1,
                "moe_shared_expert_gate": False}  # fmt: skip
    computes |= {name: settings.get(name, LLAMA_STYLE[name]) for name in _LONG_CONTEXT_FIELDS}
    config = moe_config(settings, shapes, tokens, dtype, "llama4_text", None, "sigmoid",
                        **computes)  # fmt: skip
    moe_layers = [i for i, s in enumerate(sparse) if s]
    no_rope = [i for i, r in enumerate(rotating) if not r]
    return config | {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "intermediate_size": shapes["expert_ffn"],
        "intermediate_size_mlp": shapes.get("ffn") or settings.get("ffn_hidden_size"),
        "num_local_experts": shapes["experts"], "moe_layers": moe_layers,
        "interleave_moe_layer_step": interval_of(moe_layers, layers, 1),
        "no_rope_layers": rotating, "no_rope_layer_interval": interval_of(no_rope, layers, 4),
        "layer_types": ["chunked_attention" if r else "full_attention" for r in rotating],
        "use_qk_norm": qk_norm, "attention_bias": False, "router_jitter_noise": 0.0,
        **_long_context(settings, config["max_position_embeddings"]),
    }  # fmt: skip


FAMILY = Family("llama4_text", "Llama4ForCausalLM", RULES, _settings, _config)
