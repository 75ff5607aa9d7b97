"""Model families as data: one file per family, each a table of its parameters.

    ARCHITECTURES               every family's Hugging Face model_type (no torch import,
                                for `mp-ckpt --help`)
    family(model_type)          its Family (table.py): rules and config.json mapping (an
                                alias in ALIASES: the family it names; one in REFUSED:
                                an error saying why not)
    family_of(settings)         the family a model's settings describe, for a checkpoint
                                that does not say which it was imported as

Adding a family is a file here (its Rules, its settings <-> config.json functions, a
FAMILY) and its name in ARCHITECTURES. Import and export (mp_ckpt.hf) loop over its
rules; the Megatron reader and writer read the same rules through megatron_view.py
(Megatron's names and fusions), completed by gpt_model.py's table of every tensor
mp's GPTModel can have.
"""

from __future__ import annotations

import importlib

__all__ = ["ALIASES", "ARCHITECTURES", "REFUSED", "family", "family_of"]

ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "nemotron", "mixtral",
                 "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                 "deepseek_v32", "glm_moe_dsa", "glm4_moe", "llama4_text", "nemotron_h",
                 "qwen3_next", "smollm3", "phi3", "seed_oss", "ernie4_5",
                 "glm4_moe_lite", "olmo2", "olmo3", "olmoe", "gemma3_text",
                 "minimax_m2", "glm4", "exaone4", "arcee", "flex_olmo",
                 "granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                 "bamba", "gemma", "ministral3", "qwen3_5_text", "qwen3_5_moe_text")  # fmt: skip


ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model_types read as another family's: Kimi K2's names DeepSeek-V3's
architecture (DeepseekV3ForCausalLM, its layers and routing) under a model_type of its own."""

REFUSED = {
    "gemma3": "Gemma 3's image-and-text model (Gemma3ForConditionalGeneration): mp converts "
    "its text model alone, a checkpoint of model_type 'gemma3_text' (Gemma3ForCausalLM)",
    "llama4": "Llama 4's image-and-text model (Llama4ForConditionalGeneration): mp converts "
    "its text model alone, a checkpoint of model_type 'llama4_text' (Llama4ForCausalLM)",
    "mistral3": "Mistral 3's image-and-text model (Mistral3ForConditionalGeneration): mp "
    "converts its text model alone, a checkpoint of model_type 'mistral' (Mistral Small 3.1, "
    "3.2) or 'ministral3' (Ministral 3), as its text_config says",
    "kimi_k25": "Kimi K2.5's image-and-text model (Kimi_K25ForConditionalGeneration): mp "
    "converts its text model alone, a checkpoint of model_type 'deepseek_v3' (or 'kimi_k2')",
    "qwen3_5": "Qwen3.5's image-and-text model (Qwen3_5ForConditionalGeneration): mp converts "
    "its text model alone, a checkpoint of model_type 'qwen3_5_text' (Qwen3_5ForCausalLM)",
    "qwen3_5_moe": "Qwen3.5 MoE's image-and-text model (Qwen3_5MoeForConditionalGeneration): "
    "mp converts its text model alone, a checkpoint of model_type 'qwen3_5_moe_text' "
    "(Qwen3_5MoeForCausalLM)",
}
"""config.json model_types near a family's that mp does not convert, and why."""


def family(model_type: str):
    model_type = ALIASES.get(model_type, model_type)
    if model_type in REFUSED:
        raise ValueError(f"model_type {model_type!r} is {REFUSED[model_type]}")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}: mp-ckpt converts {', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"mp_ckpt.families.{model_type}").FAMILY


def family_of(settings: dict) -> str:
    """The family whose layers the settings describe (the first that fits, most specific first): a
    hybrid layer pattern (Mamba layers) whose layers are a mixer then a gated SiLU MLP, each
    layer's MLP of one kind, is Bamba where the MLPs are dense, half of each head rotates and
    Granite's multipliers are 1, else Granite 4; another hybrid pattern is Nemotron-H; gated
    DeltaNet layers Qwen3-Next with experts, else Qwen3.5; multi-latent attention is GLM-5 with
    DeepSeek's sparse attention (experimental_attention_variant "dsa") whose indexer rotates in
    interleaved pairs, DeepSeek-V3.2 with other sparse attention, DeepSeek-V3 with sigmoid
    router scores, else DeepSeek-V2; learned positions are GPT-2; normalized sublayer inputs and
    outputs Gemma 3 with scaled embeddings, else GLM-4; normalized sublayer outputs EXAONE 4.0
    with per-head query/key norms, FlexOlmo with experts, OLMo 3 with a window, else OLMo 2;
    layers without rotary embeddings in a dense model without Llama 4's other features are
    SmolLM3; L2-normalized queries and keys, layers without rotary embeddings, routing weights
    on the experts' input, or interleaved rotary embeddings with experts are Llama 4; experts
    with quick GEGLU or sinks gpt-oss, with sigmoid router scores MiniMax-M2 where queries and
    keys are normalized over all heads, else GLM-4.5, with Granite's multipliers Granite MoE
    (granitemoeshared with a shared expert), with a shared expert Qwen2-MoE, with queries and
    keys normalized over all heads OLMoE, with qk-layernorm Qwen3-MoE, else Mixtral; dense with
    the rotated queries scaled by position Ministral 3, with scaled embeddings Gemma, with
    interleaved rotary embeddings ERNIE 4.5 (the Hugging Face class that computes them; Llama's
    refuses them), with Granite's multipliers Granite, with squared ReLU and plain norm weights
    Arcee, with qk-layernorm Qwen3, with LayerNorm1P Nemotron, with q/k/v biases Qwen2, with a
    sliding window Mistral, else Llama."""
    if settings.get("hybrid_layer_pattern"):
        if not _granite_hybrid(settings):
            return "nemotron_h"
        scaled = any(settings.get(name, 1.0) != 1.0 for name in _GRANITE_SCALES)
        dense = "E" not in settings["hybrid_layer_pattern"]
        partial = settings.get("rotary_percent", 1.0) == 0.5
        return "bamba" if dense and partial and not scaled else "granitemoehybrid"
    variant = settings.get("experimental_attention_variant")
    if variant in ("gdn", "gated_delta_net"):
        return "qwen3_next" if settings.get("num_moe_experts") else "qwen3_5_text"
    if settings.get("multi_latent_attention"):
        if variant == "dsa":
            return "glm_moe_dsa" if settings.get("dsa_indexer_rope_interleaved") else "deepseek_v32"
        sigmoid = settings.get("moe_router_score_function") == "sigmoid"
        return "deepseek_v3" if sigmoid else "deepseek_v2"
    if settings.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        return "gpt2"
    if settings.get("sublayer_norm", "input") == "both":
        return "gemma3_text" if settings.get("scale_word_embeddings") else "glm4"
    if settings.get("sublayer_norm", "input") == "output":
        if settings.get("qk_layernorm_scope", "head") != "all_heads":
            return "exaone4"
        if settings.get("num_moe_experts"):
            return "flex_olmo"
        return "olmo3" if settings.get("window_size") else "olmo2"
    if _smollm3(settings):
        return "smollm3"
    if _llama4(settings):
        return "llama4_text"
    if settings.get("num_moe_experts"):
        if settings.get("quick_geglu") or settings.get("softmax_type", "vanilla") != "vanilla":
            return "gpt_oss"
        all_heads = settings.get("qk_layernorm_scope", "head") == "all_heads"
        if settings.get("moe_router_score_function") == "sigmoid":
            return "minimax_m2" if all_heads else "glm4_moe"
        if any(settings.get(name, 1.0) != 1.0 for name in _GRANITE_SCALES):
            shared = settings.get("moe_shared_expert_intermediate_size")
            return "granitemoeshared" if shared else "granitemoe"
        if settings.get("moe_shared_expert_intermediate_size"):
            return "qwen2_moe"
        if all_heads:
            return "olmoe"
        return "qwen3_moe" if settings.get("qk_layernorm") else "mixtral"
    if settings.get("query_log_scale_beta"):  # rotated queries scaled by their position
        return "ministral3"
    if settings.get("scale_word_embeddings"):  # pre-norm layers with Gemma's embeddings
        return "gemma"
    if settings.get("rotary_interleaved"):  # rotary pairs (2i, 2i + 1) in a dense model
        return "ernie4_5"
    if any(settings.get(name, 1.0) != 1.0 for name in _GRANITE_SCALES):
        return "granite"
    if settings.get("activation") == "squared_relu" and not settings.get("apply_layernorm_1p"):
        return "arcee"
    if settings.get("qk_layernorm"):
        return "qwen3"
    if settings.get("apply_layernorm_1p"):
        return "nemotron"
    if settings.get("add_qkv_bias"):
        return "qwen2"
    return "mistral" if settings.get("window_size") else "llama"


_GRANITE_SCALES = ("word_embedding_multiplier", "residual_multiplier", "logits_scaling")


def _granite_hybrid(settings: dict) -> bool:
    """Granite 4's (and Bamba's) layers: gated SiLU MLPs, each after a mixer (M or *), the
    same MLP (- or E) in every layer."""
    from mp_ckpt.families.mixer_pairs import is_mixer_pairs

    pattern = settings["hybrid_layer_pattern"]
    return settings.get("activation") == "swiglu" and is_mixer_pairs(pattern)


def _smollm3(settings: dict) -> bool:
    """NoPE layers in a dense model without Llama 4's other features."""
    llama4 = ("num_moe_experts", "qk_l2_norm", "rotary_interleaved", "attention_chunk_size",
              "attn_temperature_floor_scale")  # fmt: skip
    return bool(settings.get("no_rope_freq")) and not any(settings.get(k) for k in llama4)


def _llama4(settings: dict) -> bool:
    """Llama 4's features: L2-normalized queries and keys, NoPE layers, routing weights on
    the experts' input; interleaved rotary embeddings only with experts (a dense model
    with them is Llama's layers in Meta's original layout)."""
    features = ("qk_l2_norm", "no_rope_freq", "moe_apply_probs_on_input")
    if any(settings.get(name) for name in features):
        return True
    return bool(settings.get("rotary_interleaved") and settings.get("num_moe_experts"))
