"""What DeepSeek-V2 and DeepSeek-V3 share (deepseek_v2.py, deepseek_v3.py): multi-latent
attention in every layer, a dense SwiGLU MLP in the first first_k_dense_replace layers and
routed experts beside shared experts in the others.

Hugging Face (model.layers.{i}.)         mp (decoder.layers.{i}.)
    self_attn.q_proj.weight              self_attention.linear_q_proj.weight (q_lora_rank null)
    self_attn.q_a_proj.weight            self_attention.linear_q_down_proj.weight
    self_attn.q_a_layernorm.weight       self_attention.q_layernorm.weight
    self_attn.q_b_proj.weight            self_attention.linear_q_up_proj.weight
    self_attn.kv_a_proj_with_mqa.weight  self_attention.linear_kv_down_proj.weight
    self_attn.kv_a_layernorm.weight      self_attention.kv_layernorm.weight
    self_attn.kv_b_proj.weight           self_attention.linear_kv_up_proj.weight
    self_attn.o_proj.weight              self_attention.linear_proj.weight
    mlp.{gate,up,down}_proj.weight       mlp.linear_fc1.{gate,up}.weight, mlp.linear_fc2.weight
    mlp.gate.weight, mlp.experts.{e}.*   mlp.router.weight, mlp.experts.* (moe.py)
    mlp.shared_experts.*                 mlp.shared_experts.* (moe.py, ungated)
and Llama's norms and embeddings (llama_style.py). Every tensor keeps its shape: mp's
multi-latent attention holds each head's rows together as DeepSeek does and rotates the
positional channels in DeepSeek's interleaved pairs (2i, 2i + 1), transformers'
rope_interleave true (mp_layers' multi_latent_attention.py), so each rule is a rename.

config.json -> settings, both families (the routing is each family's own):

    qk_nope_head_dim, qk_rope_head_dim   qk_head_dim, qk_pos_emb_head_dim
    q_lora_rank (null: none), kv_lora_rank, v_head_dim    the same names
    (the latent norms, always there)     qk_layernorm true, multi_latent_attention true
    rms_norm_eps                         layernorm_epsilon (and latent_norm_epsilon 1e-6
                                         where it differs: transformers' latent norms
                                         keep 1e-6 whatever it says)
    intermediate_size                    ffn_hidden_size (the dense layers)
    moe_intermediate_size                moe_ffn_hidden_size
    n_routed_experts, num_experts_per_tok    num_moe_experts, moe_router_topk
    n_shared_experts n                   moe_shared_expert_intermediate_size n x moe_ffn_hidden_size
    first_k_dense_replace k              moe_layer_freq [0] * k + [1] * (num_layers - k)
    routed_scaling_factor                moe_router_topk_scaling_factor
    rope_parameters (or rope_scaling with rope_theta): rope_type "default" -> rope_type
        "rope"; "yarn" -> rope_type "yarn" with the yarn_* fields (yarn.py), whose
        mscale_all_dim also scales the softmax (mp_layers' mla_softmax_scale)
    aux_loss_alpha, seq_aux (DeepSeek's own keys; absent: 0 and true)    moe_aux_loss_coeff,
        moe_router_load_balancing_type "seq_aux_loss" (or "aux_loss")

The router computes in fp32 as transformers' does (moe_router_dtype "fp32"). Refused:
another activation, attention or MLP biases, num_key_value_heads other than
num_attention_heads, DeepSeek's moe_layer_freq other than 1, no expert layer at all,
a rope_type other than "default" and "yarn", and YaRN's mscale_all_dim without mscale
(transformers then scales the softmax by mscale_all_dim's factor but the rotary
embeddings by the factor alone, which mp's two mscales do not express).
"""

from __future__ import annotations

from mp_ckpt.families.hf_settings import base_config, llama_settings, refuse
from mp_ckpt.families.llama_style import dense_mlp_rules, model_rules, norm_rules
from mp_ckpt.families.moe import expert_rules, shared_expert_rules
from mp_ckpt.families.moe_settings import positive
from mp_ckpt.families.table import Rule
from mp_ckpt.families.yarn import yarn_parameters, yarn_settings

__all__ = [
    "EXPERTS",
    "LATENT_EPS",
    "RULES",
    "deepseek_config",
    "deepseek_settings",
    "dense_first_shared",
    "expert_settings",
    "groups_kept",
]

LATENT_EPS = 1e-6
"""The epsilon of transformers' latent norms (RMSNorm's default; rms_norm_eps is the
other norms'): mp's latent_norm_epsilon where rms_norm_eps differs (GLM-5's 1e-5)."""
EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
"""DeepSeek's expert names (expert_rules, unfuse_experts)."""


def _q_lora(settings: dict) -> bool:
    return settings.get("q_lora_rank") is not None


def _no_q_lora(settings: dict) -> bool:
    return settings.get("q_lora_rank") is None


_ATTN = "model.layers.{i}.self_attn."
_MLA = "self_attention."
RULES = (
    *model_rules(),
    Rule((_MLA + "linear_q_proj.weight",), _ATTN + "q_proj.weight", when=_no_q_lora),
    Rule((_MLA + "linear_q_down_proj.weight",), _ATTN + "q_a_proj.weight", when=_q_lora),
    Rule((_MLA + "q_layernorm.weight",), _ATTN + "q_a_layernorm.weight", when=_q_lora),
    Rule((_MLA + "linear_q_up_proj.weight",), _ATTN + "q_b_proj.weight", when=_q_lora),
    Rule((_MLA + "linear_kv_down_proj.weight",), _ATTN + "kv_a_proj_with_mqa.weight"),
    Rule((_MLA + "kv_layernorm.weight",), _ATTN + "kv_a_layernorm.weight"),
    Rule((_MLA + "linear_kv_up_proj.weight",), _ATTN + "kv_b_proj.weight"),
    Rule((_MLA + "linear_proj.weight",), _ATTN + "o_proj.weight"),
    *norm_rules(),
    *dense_mlp_rules(),
    *expert_rules(*EXPERTS),
    *shared_expert_rules("shared_experts", gated=False),
)
"""The rules both families share (DeepSeek-V3 adds its router's correction bias)."""


def deepseek_settings(config: dict, defaults: dict) -> dict:
    """The settings of a DeepSeek config.json but for the routing; `defaults` are the
    family's for the keys a config.json may omit."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ValueError(
            f"config.json num_key_value_heads={kv_heads}: multi-latent attention gives each "
            f"of the num_attention_heads={heads} heads its own key and value"
        )
    refuse(config, "moe_layer_freq", 1)
    max_positions = config.get("max_position_embeddings", defaults["max_position_embeddings"])
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, dict) or any(isinstance(v, dict) for v in parameters.values()):
        raise ValueError(
            f"config.json rope_parameters={parameters!r}: mp reads one set of rotary "
            "parameters for every layer"
        )
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    rope: dict = {"rope_type": "rope"}
    if kind == "yarn":
        if parameters.get("mscale_all_dim") and not parameters.get("mscale"):
            raise ValueError(
                f"config.json rope_parameters mscale_all_dim={parameters['mscale_all_dim']!r} "
                "without mscale: transformers scales the softmax by mscale_all_dim but the "
                "rotary embeddings by the factor alone, which mp's yarn_mscale and "
                "yarn_mscale_all_dim do not express"
            )
        given = {"original_max_position_embeddings": max_positions} | parameters
        rope = yarn_settings(given, max_positions) | {"position_embedding_type": "rope",
                                                      "rope_type": "yarn"}  # fmt: skip
    elif kind != "default":
        raise ValueError(
            f"config.json rope_type={kind!r}: mp's multi-latent attention rotates with "
            "rope_type 'default' or 'yarn'"
        )
    plain = {k: v for k, v in config.items() if k not in ("rope_scaling", "head_dim")}
    plain |= {"rope_parameters": {"rope_type": "default", "rope_theta": theta},
              "intermediate_size": positive(config, "intermediate_size", defaults)}  # fmt: skip
    base = llama_settings(plain, max_positions=max_positions)
    if base["layernorm_epsilon"] != LATENT_EPS:  # transformers' latent norms keep theirs
        base["latent_norm_epsilon"] = LATENT_EPS
    del base["kv_channels"]  # MLA's widths are its own fields
    experts = expert_settings(config, defaults, base["num_layers"], "DeepSeek")
    q_lora = config.get("q_lora_rank", defaults["q_lora_rank"])
    if q_lora is not None:
        q_lora = positive({"q_lora_rank": q_lora}, "q_lora_rank", {})
    return base | rope | experts | {
        "multi_latent_attention": True, "q_lora_rank": q_lora,
        "kv_lora_rank": positive(config, "kv_lora_rank", defaults),
        "qk_head_dim": positive(config, "qk_nope_head_dim", defaults),
        "qk_pos_emb_head_dim": positive(config, "qk_rope_head_dim", defaults),
        "v_head_dim": positive(config, "v_head_dim", defaults), "qk_layernorm": True,
    }  # fmt: skip


def expert_settings(config: dict, defaults: dict, layers: int, arch: str) -> dict:
    """The expert settings of DeepSeek's layout (GLM-4.5's too): dense layers first
    (first_k_dense_replace), then routed experts beside ungated shared experts; the router
    in fp32, DeepSeek's balancing keys (absent: a sequence-level loss of weight 0).
    `defaults` are the family's for the keys config.json may omit, `arch` its name in
    errors."""
    dense = config.get("first_k_dense_replace", defaults["first_k_dense_replace"])
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense < layers:
        raise ValueError(
            f"config.json first_k_dense_replace={dense!r}: expected 0 to num_hidden_layers - 1 "
            f"= {layers - 1} (mp converts {arch} models with expert layers)"
        )
    experts = positive(config, "n_routed_experts", defaults)
    topk = positive(config, "num_experts_per_tok", defaults)
    if topk > experts:
        raise ValueError(
            f"config.json num_experts_per_tok={topk}: more than n_routed_experts={experts}"
        )
    expert_ffn = positive(config, "moe_intermediate_size", defaults)
    return {
        "num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": expert_ffn,
        "moe_shared_expert_intermediate_size":
            positive(config, "n_shared_experts", defaults) * expert_ffn,
        "moe_shared_expert_gate": False, "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_router_topk_scaling_factor":
            float(config.get("routed_scaling_factor", defaults["routed_scaling_factor"])),
        "moe_router_dtype": "fp32", "moe_z_loss_coeff": None,
        "moe_router_load_balancing_type":
            "seq_aux_loss" if config.get("seq_aux", True) else "aux_loss",
        "moe_aux_loss_coeff": float(config.get("aux_loss_alpha", 0.0)),
    }  # fmt: skip


def groups_kept(settings: dict) -> tuple[int, int] | None:
    """(moe_router_num_groups, moe_router_group_topk) when the groups limit the choice
    (fewer kept than there are), else None."""
    groups, kept = settings.get("moe_router_num_groups"), settings.get("moe_router_group_topk")
    if groups is None or kept is None or kept >= groups:
        return None
    return groups, kept


# --- export ------------------------------------------------------------------------------


def _balancing(settings: dict) -> dict:
    """DeepSeek's aux_loss_alpha and seq_aux, written only for a loss it describes."""
    kind = settings.get("moe_router_load_balancing_type", "aux_loss")
    coeff = settings.get("moe_aux_loss_coeff", 0.0)
    if isinstance(kind, (list, tuple)):  # several losses: DeepSeek's keys describe one
        given = dict(zip(kind, coeff, strict=True))
        kind = "seq_aux_loss" if given.get("seq_aux_loss") else "aux_loss"
        coeff = given.get(kind, 0.0)
    if not coeff or kind not in ("aux_loss", "seq_aux_loss"):
        return {}
    return {"aux_loss_alpha": coeff, "seq_aux": kind == "seq_aux_loss"}


def dense_first_shared(shapes: dict, model_type: str) -> tuple[int, int]:
    """(first_k_dense_replace, n_shared_experts) of a model whose dense layers come first,
    then expert layers beside shared experts n x moe_ffn_hidden_size wide (DeepSeek's
    layout, GLM-4.5's); raises for another."""
    sparse = shapes["sparse"]
    dense = sparse.index(1) if 1 in sparse else len(sparse)
    if dense == len(sparse) or sparse != [0] * dense + [1] * (len(sparse) - dense):
        raise ValueError(
            f"model_config moe_layer_freq={sparse!r}: {model_type} has dense layers first, "
            "then expert layers only (first_k_dense_replace)"
        )
    shared, rest = divmod(shapes.get("shared_ffn") or 0, shapes["expert_ffn"])
    if not shared or rest:
        raise ValueError(
            f"model_config moe_shared_expert_intermediate_size={shapes.get('shared_ffn')!r}: "
            f"{model_type}'s shared experts are n_shared_experts x moe_ffn_hidden_size="
            f"{shapes['expert_ffn']} wide"
        )
    return dense, shared


def deepseek_config(settings: dict, shapes: dict, tokens: dict, dtype: str,
                    model_type: str) -> dict:  # fmt: skip
    """The config.json keys both families write but for the routing."""
    settings = {"layernorm_epsilon": 1e-5} | settings  # base_config's default when absent
    latent = settings.get("latent_norm_epsilon")
    if (settings["layernorm_epsilon"] if latent is None else latent) != LATENT_EPS:
        given = ("None (layernorm_epsilon=" + repr(settings["layernorm_epsilon"]) + ")"
                 if latent is None else repr(latent))  # fmt: skip
        raise ValueError(
            f"model_config latent_norm_epsilon={given}: transformers' {model_type} normalizes "
            f"the latents (q_a_layernorm, kv_a_layernorm) with {LATENT_EPS} whatever "
            "rms_norm_eps says"
        )
    position = settings.get("position_embedding_type", "rope")
    computes = {"qk_layernorm": True, "multi_latent_attention": True,
                "position_embedding_type": position if position in ("rope", "yarn") else "rope",
                "moe_expert_capacity_factor": None, "moe_shared_expert_gate": False}  # fmt: skip
    dense, shared = dense_first_shared(shapes, model_type)
    ffn = shapes.get("ffn") or settings.get("ffn_hidden_size")
    config = base_config(settings, shapes | {"ffn": ffn}, tokens, dtype, model_type, **computes)
    if position == "yarn" or settings.get("rope_type") in (None, "yarn"):
        config["rope_parameters"] = yarn_parameters(settings)
    dn, dr = settings["qk_head_dim"], settings["qk_pos_emb_head_dim"]
    return config | {
        "q_lora_rank": settings.get("q_lora_rank"), "kv_lora_rank": settings["kv_lora_rank"],
        "qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "qk_head_dim": dn + dr, "head_dim": dr,
        "v_head_dim": settings["v_head_dim"], "n_routed_experts": shapes["experts"],
        "num_experts_per_tok": settings["moe_router_topk"],
        "moe_intermediate_size": shapes["expert_ffn"], "n_shared_experts": shared,
        "first_k_dense_replace": dense,
        "routed_scaling_factor": float(settings.get("moe_router_topk_scaling_factor") or 1.0),
        "attention_bias": False, "output_router_logits": False, "pretraining_tp": 1,
        "use_cache": True, **_balancing(settings),
    }  # fmt: skip
