"""Qwen2-MoE (model_type "qwen2_moe", Qwen2MoeForCausalLM): Qwen2's attention (q/k/v
biases where qkv_bias), mixture-of-experts layers where decoder_sparse_step and
mlp_only_layers say (dense SwiGLU layers elsewhere), each with a shared expert scaled
by sigmoid(x @ shared_expert_gate.T) (moe_shared_expert_gate=True). The top-k weights
are the full softmax's unless norm_topk_prob.

The export writes the keys transformers 5 writes; the sliding-window keys have no
effect while use_sliding_window is false and are written as transformers writes them
then (sliding_window 0, max_window_layers 28, layer_types all "full_attention")."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import head_dim_where_it_differs, llama_settings
from mp_ckpt.families.llama_style import attention_rules, dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, shared_expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing, sparse_layers, sparse_step
from mp_ckpt.families.qwen_windows import QWEN_MAX_WINDOW_LAYERS, refuse_qwen_windows
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632, "intermediate_size": 5632}  # fmt: skip
RULES = (*model_rules(), *attention_rules(qkv_bias=None), *norm_rules(), *dense_mlp_rules(),
         *expert_rules(*_EXPERTS), *shared_expert_rules())  # fmt: skip


def _settings(config: dict) -> dict:
    refuse_qwen_windows(config)
    if config.get("norm_topk_prob", False) not in (True, False):
        raise ValueError(
            f"config.json norm_topk_prob={config['norm_topk_prob']!r}: expected true or false"
        )
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    base = llama_settings(config | {"intermediate_size": ffn}, rope_theta=10000.0,
                          rms_norm_eps=1e-6, max_positions=32768)  # fmt: skip
    return base | routing(config, "num_experts", _DEFAULTS) | {
        "add_qkv_bias": bool(config.get("qkv_bias", True)),
        "moe_ffn_hidden_size": positive(config, "moe_intermediate_size", _DEFAULTS),
        "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        "moe_shared_expert_intermediate_size": positive(
            config, "shared_expert_intermediate_size", _DEFAULTS),
        "moe_shared_expert_gate": True,
        "moe_layer_freq": sparse_layers(config),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    step, dense = sparse_step(shapes["sparse"])
    config = moe_config(settings, shapes, tokens, dtype, "qwen2_moe", None) | {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "intermediate_size": shapes["ffn"], "moe_intermediate_size": shapes["expert_ffn"],
        "shared_expert_intermediate_size": shapes["shared_ffn"],
        "num_experts": shapes["experts"], "decoder_sparse_step": step, "mlp_only_layers": dense,
        "norm_topk_prob": not settings.get("moe_router_pre_softmax", False),
        "qkv_bias": bool(settings.get("add_qkv_bias")), "use_sliding_window": False,
        "sliding_window": 0, "max_window_layers": QWEN_MAX_WINDOW_LAYERS,
        "layer_types": ["full_attention"] * shapes["layers"],
    }  # fmt: skip
    return head_dim_where_it_differs(config, shapes)  # written only where it differs


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*_EXPERTS))  # fmt: skip
