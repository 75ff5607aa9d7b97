"""Mixtral (model_type "mixtral", MixtralForCausalLM): Llama's attention and norms, every
layer a mixture of experts; the top-k probabilities renormalized (a softmax over the k
largest logits: moe_router_pre_softmax=False). Experts saved one by one under
block_sparse_moe (w1 the gate, w3 the up, w2 the down projection)."""

from __future__ import annotations

from mp_ckpt.families.hf_settings import llama_settings
from mp_ckpt.families.llama_style import attention_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, unfuse_experts
from mp_ckpt.families.moe_settings import moe_config, positive, routing
from mp_ckpt.families.table import Family

__all__ = ["FAMILY"]

_EXPERTS = ("block_sparse_moe", "w1", "w3", "w2")
_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336}
RULES = (*model_rules(), *attention_rules(), *norm_rules(), *expert_rules(*_EXPERTS))


def _settings(config: dict) -> dict:
    if config.get("sliding_window") is not None:
        raise ValueError(
            f"config.json sliding_window={config['sliding_window']!r}: mp's Mixtral attends "
            "to every earlier position; only sliding_window=null is computed"
        )
    if config.get("router_jitter_noise"):
        raise ValueError(
            f"config.json router_jitter_noise={config['router_jitter_noise']!r}: mp's router "
            "computes only router_jitter_noise=0.0"
        )
    ffn = positive(config, "intermediate_size", _DEFAULTS)
    base = llama_settings(config | {"intermediate_size": ffn}, rope_theta=1e6,
                          rms_norm_eps=1e-5, max_positions=4096 * 32)  # fmt: skip
    return base | routing(config, "num_local_experts", _DEFAULTS) | {
        "moe_ffn_hidden_size": ffn, "moe_router_pre_softmax": False,
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
        "moe_layer_freq": [1],
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    return moe_config(settings, shapes, tokens, dtype, "mixtral", False) | {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "intermediate_size": shapes["expert_ffn"], "num_local_experts": shapes["experts"],
        "router_jitter_noise": 0.0, "sliding_window": None,
    }  # fmt: skip


FAMILY = Family("mixtral", "MixtralForCausalLM", RULES, _settings, _config,
                prepare=unfuse_experts(*_EXPERTS))  # fmt: skip
