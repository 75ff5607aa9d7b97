"""OLMoE (model_type "olmoe", OlmoeForCausalLM): Llama's pre-norm layers with OLMo 2's
query and key norms over all heads (qk_layernorm_scope "all_heads": q_norm [hidden],
k_norm [key heads x head_dim]) and every MLP a mixture of experts without a shared one:
a softmax over all experts, the top k kept, renormalized only with norm_topk_prob (the
released models leave it false: moe_router_pre_softmax); the Switch load-balancing loss
(router_aux_loss_coef). Experts as Qwen3-MoE's (mlp.experts.{e}.{gate,up,down}_proj,
transformers' fused in-memory form read too).

Refused besides Llama's: clip_qkv (clamping queries, keys and values), attention_bias, and
a head width other than hidden / heads (OLMoE's query norm spans hidden_size).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import llama_settings
from mp_ckpt.families.llama_style import attention_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.table import Family

__all__ = ["EXPERTS", "FAMILY", "expert_config", "expert_layers"]

EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
_DEFAULTS = {"num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 1024}
_NORMS = {"qk_layernorm": True, "qk_layernorm_scope": "all_heads"}
RULES = (*model_rules(), *attention_rules(qk_norm=True), *norm_rules(),
         *expert_rules(*EXPERTS))  # fmt: skip


def _settings(config: dict) -> dict:
    if config.get("clip_qkv") is not None:
        raise ValueError(
            f"config.json clip_qkv={config['clip_qkv']!r}: mp does not clamp queries, keys "
            "and values; only clip_qkv=null is computed"
        )
    width = config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim") not in (None, width):
        raise ValueError(
            f"config.json head_dim={config['head_dim']!r}: OLMoE's query norm spans "
            f"hidden_size, so its heads are hidden_size / num_attention_heads = {width} wide"
        )
    return expert_layers(config, _DEFAULTS, rms_norm_eps=1e-5, rope_theta=10000.0) | _NORMS


def expert_layers(config: dict, defaults: dict, *, rms_norm_eps: float,
                  rope_theta: float) -> dict:  # fmt: skip
    """The settings of OLMoE's layers (FlexOlmo's too) but their norms: Llama's attention,
    every MLP num_experts experts of intermediate_size, softmax routing, the top k
    renormalized only with norm_topk_prob."""
    ffn = positive(config, "intermediate_size", defaults)
    base = llama_settings(config | {"intermediate_size": ffn}, rms_norm_eps=rms_norm_eps,
                          rope_theta=rope_theta, max_positions=4096)  # fmt: skip
    norm_topk = config.get("norm_topk_prob", False)
    if norm_topk not in (True, False):
        raise ValueError(f"config.json norm_topk_prob={norm_topk!r}: expected true or false")
    return base | routing(config, "num_experts", defaults) | {
        "moe_ffn_hidden_size": ffn, "moe_router_pre_softmax": not norm_topk,
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
        "moe_layer_freq": [1],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    if shapes["head_dim"] != shapes["hidden"] // shapes["heads"]:
        raise ValueError(
            f"model_config kv_channels={shapes['head_dim']}: OLMoE's heads are hidden_size / "
            f"num_attention_heads = {shapes['hidden'] // shapes['heads']} wide"
        )
    config = expert_config(settings, shapes, tokens, dtype, "olmoe", _NORMS)
    del config["head_dim"]  # not a key of OlmoeConfig
    return config | {"architectures": ["OlmoeForCausalLM"], "clip_qkv": None}


def expert_config(settings: dict, shapes: dict, tokens: dict, dtype: str, model_type: str,
                  norms: dict) -> dict:  # fmt: skip
    """config.json of expert_layers' settings with the family's `norms`."""
    if not all(shapes["sparse"]):
        raise ValueError(f"model_config moe_layer_freq: every {model_type} layer is a "
                         "mixture of experts")  # fmt: skip
    config = moe_config(settings, shapes, tokens, dtype, model_type, None, **norms)
    return config | {
        "model_type": model_type, "intermediate_size": shapes["expert_ffn"],
        "num_experts": shapes["experts"],
        "norm_topk_prob": not settings.get("moe_router_pre_softmax", False),
        "attention_bias": False,
    }  # fmt: skip


FAMILY = Family("olmoe", "OlmoeForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*EXPERTS))  # fmt: skip
