"""gpt-oss (model_type "gpt_oss", GptOssForCausalLM): every layer a mixture of experts,
attention with sinks and biases, a sliding window on alternate layers, YaRN rotary.

Megatron's flags for it: --softmax-type learnable (a learnable logit per head in each
softmax row: the sinks), --window-size W-1,0 --window-attn-skip-freq 2 (Hugging Face's
sliding_window W, layer_types alternating from "sliding_attention"), --position-embedding-
type yarn, --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value L
(swiglu_limit; swiglu_alpha must be quick GELU's 1.702), and biases everywhere but the
norms (add_bias_linear, add_qkv_bias): q/k/v/o, the router, the experts. The router
takes the top k of its logits, then a softmax over those k (moe_router_pre_softmax
False).

Experts are stored fused: gate_up_proj [E, h, 2F] with the gate in the even columns and
the up projection in the odd ones, its bias [E, 2F] the same way, and down_proj
[E, F, h] (transposed against mp's [E, h, F]).
"""

from __future__ import annotations

import torch

from mp_ckpt.families.hf_settings import llama_settings, refuse
from mp_ckpt.families.llama_style import attention_rules, model_rules, norm_rules
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.table import Dims, Family, Rule
from mp_ckpt.families.window import layer_types, sliding_window, window_settings
from mp_ckpt.families.yarn import yarn_parameters, yarn_settings

__all__ = ["FAMILY"]

_QUICK_GELU_ALPHA = 1.702
_DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "intermediate_size": 2880}
_MLP = "model.layers.{i}.mlp."
_FC1 = ("mlp.experts.linear_fc1.gate", "mlp.experts.linear_fc1.up")
_EXPERTS_FC1, _EXPERTS_FC2 = "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"


def _split(t, dims: Dims) -> list[torch.Tensor]:
    """gate_up_proj [E, h, 2F] (gate even, up odd) -> gate, up [E, F, h]; the bias [E, 2F]
    -> [E, F] each."""
    fused = t[0] if t[0].dim() == 2 else t[0].transpose(1, 2)
    return [fused[:, 0::2].contiguous(), fused[:, 1::2].contiguous()]


def _interleave(t, dims: Dims) -> list[torch.Tensor]:
    fused = torch.stack([t[0], t[1]], dim=2).flatten(1, 2)  # [E, 2F(, h)], gate first
    return [fused if fused.dim() == 2 else fused.transpose(1, 2).contiguous()]


def _swap(t, dims: Dims) -> list[torch.Tensor]:
    return [t[0].transpose(1, 2).contiguous()]


RULES = (
    *model_rules(),
    *attention_rules(qkv_bias=True, proj_bias=True),
    Rule(("self_attention.core_attention.softmax_offset",), "model.layers.{i}.self_attn.sinks"),
    *norm_rules(),
    Rule(("mlp.router.weight",), _MLP + "router.weight", "moe"),
    Rule(("mlp.router.bias",), _MLP + "router.bias", "moe"),
    Rule(tuple(f"{p}.weight" for p in _FC1), _MLP + "experts.gate_up_proj", "moe",
         to_mp=_split, to_hf=_interleave, megatron=_EXPERTS_FC1),
    Rule(tuple(f"{p}.bias" for p in _FC1), _MLP + "experts.gate_up_proj_bias", "moe",
         to_mp=_split, to_hf=_interleave, megatron=_EXPERTS_FC1),
    Rule(("mlp.experts.linear_fc2.weight",), _MLP + "experts.down_proj", "moe",
         to_mp=_swap, to_hf=_swap, megatron=_EXPERTS_FC2),
    Rule(("mlp.experts.linear_fc2.bias",), _MLP + "experts.down_proj_bias", "moe",
         megatron=_EXPERTS_FC2),
)  # fmt: skip


def _settings(config: dict) -> dict:
    refuse(config, "attention_bias", True)
    refuse(config, "swiglu_alpha", _QUICK_GELU_ALPHA)
    limit = config.get("swiglu_limit", 7.0)
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    max_positions = config.get("max_position_embeddings", 131072)
    yarn = {}
    if parameters.get("rope_type", parameters.get("type")) == "yarn":
        yarn = yarn_settings(parameters, max_positions)
        parameters = {"rope_type": "default", "rope_theta": parameters.get("rope_theta", 150000)}
    plain = {k: v for k, v in config.items() if k not in ("attention_bias", "hidden_act")}
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    plain |= {"rope_parameters": parameters, "intermediate_size": ffn}
    base = llama_settings(plain, rms_norm_eps=1e-5, max_positions=max_positions)
    windows = window_settings(config.get("sliding_window"), config.get("layer_types"),
                              base["num_layers"])  # fmt: skip
    return base | yarn | windows | routing(config, "num_local_experts", _DEFAULTS) | {
        "activation": "gelu", "quick_geglu": True, "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(limit), "add_bias_linear": True,
        "add_qkv_bias": True, "softmax_type": "learnable", "moe_ffn_hidden_size": ffn,
        "moe_router_pre_softmax": False, "moe_shared_expert_intermediate_size": None,
        "moe_shared_expert_gate": False, "moe_layer_freq": [1],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    layers = shapes["layers"]
    window, freq = settings.get("window_size"), settings.get("window_attn_skip_freq")
    computes = {
        "activation": "gelu", "quick_geglu": True, "glu_linear_offset": 1.0,
        "activation_func_clamp_value": settings.get("activation_func_clamp_value"),
        "softmax_type": "learnable", "add_bias_linear": True,
        "position_embedding_type": settings.get("position_embedding_type", "rope"),
        "window_size": tuple(window) if window else None, "window_attn_skip_freq": freq,
    }  # fmt: skip
    position = computes["position_embedding_type"]
    if position not in ("rope", "yarn"):
        raise ValueError(f"model_config position_embedding_type={position!r}: gpt_oss "
                         "computes rope or yarn")  # fmt: skip
    config = moe_config(settings, shapes, tokens, dtype, "gpt_oss", False, **computes)
    if computes["position_embedding_type"] == "yarn":
        config["rope_parameters"] = yarn_parameters(settings)
    return config | {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": True, "intermediate_size": shapes["expert_ffn"],
        "num_local_experts": shapes["experts"], "sliding_window": sliding_window(settings, layers),
        "layer_types": layer_types(settings, layers), "swiglu_alpha": _QUICK_GELU_ALPHA,
        "swiglu_limit": settings.get("activation_func_clamp_value"),
    }  # fmt: skip


FAMILY = Family("gpt_oss", "GptOssForCausalLM", RULES, _settings, _config)
