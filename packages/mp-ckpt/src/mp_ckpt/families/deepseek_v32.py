"""DeepSeek-V3.2-Exp (model_type "deepseek_v32", DeepseekV32ForCausalLM): DeepSeek-V3
(deepseek_v3.py: its layers, routing and multi-token prediction) with DeepSeek Sparse
Attention, a lightning indexer in each multi-latent attention layer that picks, for each
query, the index_topk earlier tokens the attention reads.

Hugging Face (model.layers.{i}.       mp (decoder.layers.{i}.self_attention.
    self_attn.indexer.)                   core_attention.indexer.)
    wq_b.weight [Hi di, q_lora_rank]     linear_wq_b.weight
    wk.weight [di, h]                    linear_wk.weight
    k_norm.weight, k_norm.bias [di]      k_norm.weight, k_norm.bias
    weights_proj.weight [Hi, h]          linear_weights_proj.weight
(Hi index_n_heads, di index_head_dim), each a rename; a multi-token prediction layer's
indexer likewise under its transformer_layer. mp's names are Megatron-LM's, whose DSA
module is its multi-latent attention's core attention (gpt_model.py).

What the indexer computes (mp_layers' sparse attention): queries q = wq_b(c_q) from the
normalized query latent c_q in Hi heads of di channels, one key k = k_norm(wk(x)) (a
LayerNorm of epsilon 1e-6), both rotated on their first qk_rope_head_dim channels in two
halves (transformers' rotate_half, not multi-latent attention's interleaved pairs); the
score of token t for query s, sum_j weights_proj(x_s)_j Hi^-1/2 relu(q_sj . k_t di^-1/2);
each query attends to the index_topk best-scored tokens up to it (all of them while there
are fewer). DeepSeek's code turns q and k by an orthonormal Hadamard rotation first,
which leaves each q . k as it is up to rounding; transformers does not.

config.json -> settings, beside DeepSeek-V3's:

    index_n_heads, index_head_dim        dsa_indexer_n_heads, dsa_indexer_head_dim
    index_topk                           dsa_indexer_topk
    (always)                             experimental_attention_variant "dsa",
        dsa_indexer_k_norm_epsilon 1e-6, dsa_indexer_rope_interleaved false,
        dsa_indexer_scoring_relu true, dsa_indexer_topk_freq 1 (each layer its own
        choice), dsa_indexer_rotate_activation true (DeepSeek's rotation; false where
        index_head_dim is not a power of 2, the sizes mp's rotation takes)
    mlp_layer_types ("dense" x k, then "sparse")    first_k_dense_replace k

The indexer's loss (dsa_indexer_loss_coeff) trains it and is left unset. rope_interleave
is not read: DeepseekV32Config has no such key and always rotates multi-latent
attention's positional channels in DeepSeek's pairs, as mp does.

Refused besides deepseek_v3.py's (all but its rope_interleave): q_lora_rank null
(transformers' DeepseekV32 always has a query latent, which the indexer reads),
index_head_dim below qk_rope_head_dim, layer_types other than "indexed_attention",
mlp_layer_types other than dense layers then expert layers or disagreeing with
first_k_dense_replace. The export refuses settings whose indexer transformers computes
otherwise (scores without relu, interleaved rotation, a choice shared by
dsa_indexer_topk_freq layers, another key-norm epsilon; deepseek_v2 and deepseek_v3
refuse sparse attention) and writes DeepSeek-V3's keys but rope_interleave and
pretraining_tp, which DeepseekV32Config lacks, num_nextn_predict_layers only for a model
with multi-token prediction layers. export-hf's --dtype casts weights_proj as any tensor
(transformers computes it in fp32 whatever it is stored in: _keep_in_fp32_modules).
GLM-5 (glm_moe_dsa.py) shares the table, dsa_settings and dsa_config.
"""

from __future__ import annotations

from mp_ckpt.families import deepseek_v3
from mp_ckpt.families.hf_settings import check_computes
from mp_ckpt.families.moe_settings import positive
from mp_ckpt.families.table import Family, Rule

__all__ = ["FAMILY", "K_NORM_EPS", "RULES", "dsa_config", "dsa_settings"]

K_NORM_EPS = 1e-6
"""The epsilon of the indexer's key norm (transformers' DeepseekV32Indexer: fixed)."""
_DEFAULTS = deepseek_v3.DEFAULTS | {
    "max_position_embeddings": 163840, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 2048,
}  # fmt: skip
"""transformers' DeepseekV32Config defaults, for a key config.json omits."""
_ARCH = "DeepSeek-V3.2"

_HF = "model.layers.{i}.self_attn.indexer."
_MP = "self_attention.core_attention.indexer."
RULES = (
    *deepseek_v3.RULES,
    Rule((_MP + "linear_wq_b.weight",), _HF + "wq_b.weight", "indexer"),
    Rule((_MP + "linear_wk.weight",), _HF + "wk.weight", "indexer"),
    Rule((_MP + "k_norm.weight",), _HF + "k_norm.weight", "indexer"),
    Rule((_MP + "k_norm.bias",), _HF + "k_norm.bias", "indexer"),
    Rule((_MP + "linear_weights_proj.weight",), _HF + "weights_proj.weight", "indexer"),
)
"""DeepSeek-V3's rules and the indexer's, in each layer that has one (scope "indexer":
every layer here; GLM-5's glm_moe_dsa.py shares the table)."""

_INDEXER = {"dsa_indexer_rope_interleaved": False, "dsa_indexer_scoring_relu": True,
            "dsa_indexer_topk_freq": 1}  # fmt: skip
"""What transformers' indexer computes, under TransformerConfig's names (module
docstring); the key norm's epsilon is checked apart (None: layernorm_epsilon's)."""


def _dense_first(config: dict, arch: str) -> dict:
    """config.json with first_k_dense_replace from mlp_layer_types, which transformers'
    DeepseekV32 builds its layers by where config.json gives it."""
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return config
    layers = config["num_hidden_layers"]
    dense = kinds.count("dense") if isinstance(kinds, list) else 0
    if kinds != ["dense"] * dense + ["sparse"] * (layers - dense) or dense == layers:
        raise ValueError(
            f"config.json mlp_layer_types={kinds!r}: mp converts {arch} with "
            f"num_hidden_layers={layers} layers, dense ones first, then expert layers only"
        )
    given = config.get("first_k_dense_replace")
    if given is not None and given != dense:
        raise ValueError(
            f"config.json mlp_layer_types={kinds!r} (first {dense} dense) and "
            f"first_k_dense_replace={given!r} disagree"
        )
    return config | {"first_k_dense_replace": dense}


def dsa_settings(config: dict, defaults: dict, arch: str, model_class: str) -> dict:
    """The settings of a config.json of DeepSeek-V3's layers with DeepSeek's sparse
    attention, but for how the indexer rotates, whether it shares its choice and whether
    it rotates its activations (each family's own); `defaults` are the family's for the
    keys config.json may omit, `arch` its name in errors, `model_class` the prefix of
    transformers' classes (DeepseekV32)."""
    kinds = config.get("layer_types")
    if kinds is not None and set(kinds) != {"indexed_attention"}:
        raise ValueError(
            f"config.json layer_types={kinds!r}: {arch} has sparse attention "
            "('indexed_attention') in every layer"
        )
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        raise ValueError(
            f"config.json q_lora_rank=None: transformers' {model_class} always has a query "
            "latent, which the indexer reads"
        )
    config = {k: v for k, v in _dense_first(config, arch).items() if k != "rope_interleave"}
    base = deepseek_v3.v3_settings(config, defaults, arch)
    head_dim = positive(config, "index_head_dim", defaults)
    if head_dim < base["qk_pos_emb_head_dim"]:
        raise ValueError(
            f"config.json index_head_dim={head_dim}: the indexer rotates its first "
            f"qk_rope_head_dim={base['qk_pos_emb_head_dim']} channels"
        )
    return base | {
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": positive(config, "index_n_heads", defaults),
        "dsa_indexer_head_dim": head_dim,
        "dsa_indexer_topk": positive(config, "index_topk", defaults),
        "dsa_indexer_k_norm_epsilon": K_NORM_EPS,
    }  # fmt: skip


def _settings(config: dict) -> dict:
    settings = dsa_settings(config, _DEFAULTS, _ARCH, "DeepseekV32")
    head_dim = settings["dsa_indexer_head_dim"]
    # DeepSeek's rotation, where mp has one of that size (a power of 2)
    return settings | _INDEXER | {"dsa_indexer_rotate_activation": head_dim & (head_dim - 1) == 0}


def dsa_config(settings: dict, shapes: dict, tokens: dict, dtype: str, model_type: str,
               arch: str, model_class: str, computes: dict) -> dict:  # fmt: skip
    """The config.json of DeepSeek-V3's layers with DeepSeek's sparse attention under
    `model_type` (without "architectures"), refusing an indexer other than transformers'
    `model_class` computes: `computes` (TransformerConfig's names) besides the key norm's
    epsilon and the query latent. DeepSeek-V3's keys but rope_interleave and pretraining_tp,
    num_nextn_predict_layers only for a model with multi-token prediction layers."""
    variant = settings.get("experimental_attention_variant")
    if variant != "dsa":  # (absent: TransformerConfig's default, None)
        raise ValueError(
            f"model_config experimental_attention_variant={variant!r}: {model_type} computes "
            "only experimental_attention_variant='dsa'"
        )
    check_computes(settings, model_type, computes)
    epsilon = settings.get("dsa_indexer_k_norm_epsilon")
    given = repr(epsilon)
    if epsilon is None:  # TransformerConfig's rule: the other norms' epsilon
        epsilon = settings.get("layernorm_epsilon", 1e-5)
        given = f"None (layernorm_epsilon={epsilon!r})"
    if epsilon != K_NORM_EPS:
        raise ValueError(
            f"model_config dsa_indexer_k_norm_epsilon={given}: transformers' {model_class} "
            f"indexer normalizes its keys with epsilon {K_NORM_EPS}"
        )
    if settings.get("q_lora_rank") is None:
        raise ValueError(
            f"model_config q_lora_rank=None: transformers' {model_class} always has a query latent"
        )
    widths = {}
    for key, field in (("index_n_heads", "dsa_indexer_n_heads"),
                       ("index_head_dim", "dsa_indexer_head_dim"),
                       ("index_topk", "dsa_indexer_topk")):  # fmt: skip
        value = settings.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"model_config {field}={value!r}: the {model_type} export "
                             f"writes it as {key}, a positive integer")  # fmt: skip
        widths[key] = value
    config = deepseek_v3.v3_config(settings, shapes, tokens, dtype, model_type, arch)
    del config["pretraining_tp"]
    mtp = config.pop("num_nextn_predict_layers")
    return config | widths | {
        "mlp_bias": False, **({"num_nextn_predict_layers": mtp} if mtp else {}),
    }  # fmt: skip


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    config = dsa_config(settings, shapes, tokens, dtype, "deepseek_v32", _ARCH, "DeepseekV32",
                        _INDEXER)  # fmt: skip
    return {"architectures": ["DeepseekV32ForCausalLM"]} | config


FAMILY = Family("deepseek_v32", "DeepseekV32ForCausalLM", RULES, _settings, _config,
                prepare=deepseek_v3.FAMILY.prepare, held=deepseek_v3.FAMILY.held)  # fmt: skip
