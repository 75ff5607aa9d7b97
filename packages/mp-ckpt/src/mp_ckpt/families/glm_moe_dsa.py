"""GLM-5 (model_type "glm_moe_dsa", GlmMoeDsaForCausalLM): DeepSeek-V3.2's layers, routing,
multi-token prediction and sparse attention (deepseek_v32.py) with an indexer that rotates
its positional channels in interleaved pairs and may share its choice across layers.

Hugging Face (model.layers.{i}.       mp (decoder.layers.{i}.self_attention.
    self_attn.indexer.)                   core_attention.indexer.)
    wq_b.weight [Hi di, q_lora_rank]     linear_wq_b.weight
    wk.weight [di, h]                    linear_wk.weight
    k_norm.weight, k_norm.bias [di]      k_norm.weight, k_norm.bias
    weights_proj.weight [Hi, h]          linear_weights_proj.weight
(deepseek_v32.py's table: each a rename) in each layer that runs its own indexer (a
"full" layer, the rules' scope "indexer"); a "shared" layer has neither.

What the indexer computes differs from DeepSeek-V3.2's in two ways:
- its first qk_rope_head_dim channels of q and k turn in pairs (2i, 2i + 1), as
  multi-latent attention's do (transformers' apply_rotary_pos_emb_interleave), not in
  halves;
- cross-layer sharing (arXiv:2603.12201): a "shared" layer attends to the positions the
  last "full" layer before it chose. GlmMoeDsaConfig's indexer_types lists each layer's
  kind; absent, it is index_topk_pattern's ("F" full, "S" shared), else index_topk_freq f
  (default 1) and index_skip_topk_offset o (default 2) make 0-based layer i full when
  max(i - o + 1, 0) is a multiple of f. mp's dsa_indexer_topk_freq and
  dsa_indexer_skip_topk_offset are Megatron-LM's rule: 1-based layer L reuses a choice
  when max(L - max(o, 1), 0) is not a multiple of f, the same layers for o >= 1.

config.json -> settings, beside DeepSeek-V3.2's:

    indexer_types (or what gives it)     dsa_indexer_topk_freq f, dsa_indexer_skip_topk_offset
                                         o: 1 and 0 where every layer is full; else the f and
                                         o that give it (index_topk_freq and
                                         index_skip_topk_offset where they do)
    (always)                             dsa_indexer_rope_interleaved true,
        dsa_indexer_rotate_activation false (transformers scores without DeepSeek's
        Hadamard rotation, and Megatron-Bridge's GLM-5 settings leave it off; the scores
        are the same but for rounding), dsa_indexer_scoring_relu true,
        dsa_indexer_k_norm_epsilon 1e-6

Defaults are GlmMoeDsaConfig's (rms_norm_eps 1e-5: refused, as deepseek.py says, unless
config.json gives 1e-6; index_n_heads 32, n_group 1, ...).

Refused besides deepseek_v32.py's: indexer_types that are not "full" or "shared" for each
of num_hidden_layers layers, that begin with a shared layer (nothing to reuse:
transformers fails there too) or that no f and o give (an arbitrary pattern); shared
layers with multi-token prediction layers of which a depth would reuse another's choice
(Megatron numbers them 1, 2, ... apart: the first chooses for itself, with its own
indexer, which mp-layers gives it; a later one is refused there). The export refuses an
indexer transformers computes otherwise (halves, scores without relu, another key-norm
epsilon) and writes deepseek_v32.py's keys with indexer_types, which transformers reads
first, and, where layers share, index_topk_freq and index_skip_topk_offset (max(o, 1)),
which give the same layers.
"""

from __future__ import annotations

from mp_ckpt.families import deepseek_v3
from mp_ckpt.families.deepseek_v32 import RULES, dsa_config, dsa_settings
from mp_ckpt.families.hf_settings import check_computes
from mp_ckpt.families.table import Family, has_dsa_indexer, shared_mtp_depth

__all__ = ["FAMILY"]

_DEFAULTS = deepseek_v3.DEFAULTS | {
    "max_position_embeddings": 202752, "intermediate_size": 12288, "q_lora_rank": 2048,
    "qk_nope_head_dim": 192, "v_head_dim": 256, "n_group": 1, "topk_group": 1,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
}  # fmt: skip
"""transformers' GlmMoeDsaConfig defaults, for a key config.json omits."""
_RMS_NORM_EPS = 1e-5
"""GlmMoeDsaConfig's rms_norm_eps."""
_ARCH, _CLASS = "GLM-5", "GlmMoeDsa"

_INDEXER = {"dsa_indexer_rope_interleaved": True, "dsa_indexer_scoring_relu": True,
            "dsa_indexer_rotate_activation": False}  # fmt: skip
"""What transformers' GlmMoeDsaIndexer computes, under TransformerConfig's names."""
_PATTERN = {"F": "full", "S": "shared"}
"""index_topk_pattern's letters."""


def _kinds(freq: int, offset: int, layers: int) -> list[str]:
    """GlmMoeDsaConfig's indexer_types of index_topk_freq and index_skip_topk_offset."""
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _whole(config: dict, key: str, default: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json {key}={value!r}: expected an integer >= 0")
    return value


def _indexer_types(config: dict, layers: int) -> list[str]:
    """config.json's indexer_types, or those GlmMoeDsaConfig derives where it has none."""
    kinds, given = config.get("indexer_types"), "indexer_types"
    if kinds is None and config.get("index_topk_pattern") is not None:
        pattern, given = config["index_topk_pattern"], "index_topk_pattern"
        kinds = [_PATTERN.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    elif kinds is None:
        freq = max(_whole(config, "index_topk_freq", 1), 1)
        return _kinds(freq, _whole(config, "index_skip_topk_offset", 2), layers)
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - set(_PATTERN.values()):
        raise ValueError(f"config.json {given}={config[given]!r}: expected 'full' or 'shared' "
                         f"for each of the num_hidden_layers={layers} layers")  # fmt: skip
    return kinds


def _sharing(config: dict, kinds: list[str]) -> tuple[int, int]:
    """(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) of the layers' kinds: config.json's
    index_topk_freq and index_skip_topk_offset where they give them, else the f and o read
    off them (the first shared layer is o, the next full one o + f - 1)."""
    if "shared" not in kinds:
        return 1, 0
    first = kinds.index("shared")
    if first == 0:
        raise ValueError(f"config.json indexer_types={kinds!r}: layer 0 is 'shared', with no "
                         "earlier layer's choice to reuse")  # fmt: skip
    later = [i for i in range(first, len(kinds)) if kinds[i] == "full"]
    derived = ((later[0] if later else len(kinds)) - first + 1, first)
    given = (config.get("index_topk_freq"), config.get("index_skip_topk_offset", 2))
    for freq, offset in (given, derived):
        if (isinstance(freq, int) and isinstance(offset, int) and freq > 1 and offset >= 1
                and _kinds(freq, offset, len(kinds)) == kinds):  # fmt: skip
            return freq, offset
    raise ValueError(
        f"config.json indexer_types={kinds!r}: mp shares a choice as Megatron-LM does, "
        "the first o layers full, then one in every f (dsa_indexer_topk_freq, "
        "dsa_indexer_skip_topk_offset), which gives no such pattern"
    )


def _settings(config: dict) -> dict:
    config = {"rms_norm_eps": _RMS_NORM_EPS} | config
    settings = dsa_settings(config, _DEFAULTS, _ARCH, _CLASS)
    freq, offset = _sharing(config, _indexer_types(config, settings["num_layers"]))
    settings = settings | _INDEXER | {"dsa_indexer_topk_freq": freq,
                                      "dsa_indexer_skip_topk_offset": offset}  # fmt: skip
    depth = shared_mtp_depth(settings)
    if depth is not None:
        raise ValueError(
            f"config.json num_nextn_predict_layers={settings['mtp_num_layers']} with shared "
            f"indexer layers: multi-token prediction depth {depth} would reuse an earlier "
            "depth's choice (Megatron's rule over the modules' own numbering), which "
            "mp-layers does not implement"
        )
    return settings


def _config(settings: dict, shapes: dict, tokens: dict, dtype: str) -> dict:
    interleaved = settings.get("dsa_indexer_rope_interleaved", False)  # (TransformerConfig's)
    if interleaved is not True:
        raise ValueError(
            f"model_config dsa_indexer_rope_interleaved={interleaved!r}: transformers' "
            f"{_CLASS} indexer rotates in interleaved pairs (dsa_indexer_rope_interleaved=True)"
        )
    check_computes(settings, "glm_moe_dsa", {"dsa_indexer_scoring_relu": True})
    freq = settings.get("dsa_indexer_topk_freq", 1)
    offset = settings.get("dsa_indexer_skip_topk_offset", 0)
    for field, value, least in (("dsa_indexer_topk_freq", freq, 1),
                                ("dsa_indexer_skip_topk_offset", offset, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"model_config {field}={value!r}: expected an integer >= {least}")
    depth = shared_mtp_depth(settings)
    if depth is not None:
        raise ValueError(
            f"model_config dsa_indexer_topk_freq={freq} with mtp_num_layers="
            f"{settings['mtp_num_layers']}: multi-token prediction depth {depth} would reuse "
            "an earlier depth's choice, which mp-layers refuses"
        )
    config = dsa_config(settings, shapes, tokens, dtype, "glm_moe_dsa", _ARCH, _CLASS, {})
    layers = range(shapes["layers"])
    kinds = ["full" if has_dsa_indexer(settings, i) else "shared" for i in layers]
    sharing = {"index_topk_freq": freq, "index_skip_topk_offset": max(offset, 1)}
    return {"architectures": ["GlmMoeDsaForCausalLM"]} | config | {
        "indexer_types": kinds, **(sharing if freq > 1 else {}),
    }  # fmt: skip


FAMILY = Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", RULES, _settings, _config,
                prepare=deepseek_v3.FAMILY.prepare, held=deepseek_v3.FAMILY.held)  # fmt: skip
