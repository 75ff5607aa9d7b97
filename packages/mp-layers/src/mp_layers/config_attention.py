"""Validation of TransformerConfig's attention and position-embedding fields: rotary
settings (plain, Llama 3.1 scaling, YaRN, interleaved pairs, layers without them), QK
norms, attention sinks (softmax_type), sliding windows (window_size,
window_attn_skip_freq), and the per-layer window and rotary patterns.

TransformerConfig.__post_init__ calls `check_attention_fields`, check_parallel calls
`check_attention_parallel`; every message names the field and the value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mp_layers.config_rules import choice, positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "SOFTMAX_TYPES",
    "YARN_DEFAULTS",
    "check_attention_fields",
    "check_attention_parallel",
    "qk_l2_norm_layer_pattern",
    "rope_layer_pattern",
    "uses_yarn",
    "window_layer_pattern",
]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")

YARN_DEFAULTS = {
    "yarn_rotary_scaling_factor": 1.0,
    "yarn_original_max_position_embeddings": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}
"""Megatron's defaults (megatron/training/argument_utils.py, _apply_yarn_config_from_args)."""


def check_attention_fields(config: TransformerConfig) -> None:
    """The rules of the attention and position-embedding fields that hold whatever the
    parallel layout."""
    if config.rotary_base <= 0:
        raise ValueError(f"rotary_base={config.rotary_base} must be > 0")
    if not 0.0 < config.rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent={config.rotary_percent} must be in (0, 1]")
    factor = config.rotary_seq_len_interpolation_factor
    if factor is not None and factor < 1.0:
        raise ValueError(f"rotary_seq_len_interpolation_factor={factor} must be >= 1")
    if config.cp_comm_type not in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        raise ValueError(
            f"cp_comm_type={config.cp_comm_type!r} must be one of p2p, all_gather, a2a, a2a+p2p"
        )
    _check_rope_scaling(config)
    _check_yarn(config)
    if config.softmax_type not in SOFTMAX_TYPES:
        raise ValueError(
            f"softmax_type={config.softmax_type!r} must be one of {', '.join(SOFTMAX_TYPES)}"
        )
    _check_window(config)
    _check_rope_layers(config)


def _check_rope_scaling(config: TransformerConfig) -> None:
    if not config.use_rope_scaling:
        return
    if config.position_embedding_type != "rope":
        raise ValueError(
            "use_rope_scaling=True needs position_embedding_type='rope', got "
            f"{config.position_embedding_type!r}"
        )
    if config.rope_scaling_factor < 1.0:
        raise ValueError(f"rope_scaling_factor={config.rope_scaling_factor} must be >= 1")
    low, high = config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor
    if not 0.0 < low < high:
        raise ValueError(
            f"rope_scaling_low_freq_factor={low} and rope_scaling_high_freq_factor={high} "
            "must satisfy 0 < low < high"
        )
    original = config.rope_scaling_original_max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"rope_scaling_original_max_position_embeddings={original!r} must be a positive integer"
        )


def uses_yarn(config: TransformerConfig) -> bool:
    """Whether the rotary embeddings are YaRN's: position_embedding_type "yarn", or
    multi-latent attention with rope_type "yarn" (None: Megatron's MLA default) under any
    other position_embedding_type."""
    if config.position_embedding_type == "yarn":
        return True
    return config.multi_latent_attention and config.rope_type in (None, "yarn")


def _check_yarn(config: TransformerConfig) -> None:
    if not uses_yarn(config):
        for name, default in YARN_DEFAULTS.items():
            if getattr(config, name) != default:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} needs position_embedding_type='yarn' "
                    "(or multi_latent_attention with rope_type 'yarn'), got "
                    f"position_embedding_type={config.position_embedding_type!r}, "
                    f"rope_type={config.rope_type!r}"
                )
        return
    if config.rotary_percent != 1.0:
        raise ValueError(
            f"rotary_percent={config.rotary_percent} with position_embedding_type='yarn': YaRN "
            "rotates every channel (Megatron's YarnRotaryEmbedding); set rotary_percent=1"
        )
    if config.yarn_rotary_scaling_factor < 1.0:
        raise ValueError(
            f"yarn_rotary_scaling_factor={config.yarn_rotary_scaling_factor} must be >= 1"
        )
    original = config.yarn_original_max_position_embeddings
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"yarn_original_max_position_embeddings={original!r} must be a positive integer"
        )
    fast, slow = config.yarn_beta_fast, config.yarn_beta_slow
    if not 0.0 < slow <= fast:
        raise ValueError(
            f"yarn_beta_fast={fast} and yarn_beta_slow={slow} must satisfy 0 < slow <= fast"
        )


def _check_window(config: TransformerConfig) -> None:
    window, freq = config.window_size, config.window_attn_skip_freq
    if window is None:
        if freq is not None:
            raise ValueError(f"window_attn_skip_freq={freq!r} needs window_size")
        return
    window = tuple(window)
    if len(window) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in window):
        raise ValueError(f"window_size={config.window_size!r} must be two integers (left, right)")
    left, right = window
    if right != 0:
        raise ValueError(
            f"window_size={window}: right={right} would attend to later positions; GPT "
            "attention is causal, so right must be 0"
        )
    if left < 0:
        raise ValueError(
            f"window_size={window}: left={left} must be >= 0 (for full attention leave "
            "window_size None)"
        )
    config.window_size = window
    window_layer_pattern(config)  # validates window_attn_skip_freq


def window_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Per layer of the whole model (0-based index i): whether it attends through the
    sliding window. Megatron's rule (is_layer_window_attention) on its 1-based layer
    number n = i + 1: every layer without window_attn_skip_freq; for an integer N, the
    layers with n % N != 0 (N = 2: window, full, window, full, ...; gpt-oss's
    layer_types); for a list, its value for layer n (1 = window, 0 = full)."""
    n_layers = config.num_layers
    if config.window_size is None:
        return [False] * n_layers
    freq = config.window_attn_skip_freq
    if freq is None:
        return [True] * n_layers
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ValueError(f"window_attn_skip_freq={freq} must be a positive integer")
        return [(i + 1) % freq != 0 for i in range(n_layers)]
    pattern = list(freq)
    if len(pattern) != n_layers or any(x not in (0, 1) or isinstance(x, bool) for x in pattern):
        raise ValueError(
            f"window_attn_skip_freq={freq!r} must be an integer or {n_layers} values "
            "(num_layers) of 0 or 1"
        )
    return [bool(x) for x in pattern]


def _check_rope_layers(config: TransformerConfig) -> None:
    mla = config.multi_latent_attention
    if config.rotary_interleaved and mla:
        raise ValueError(
            "rotary_interleaved=True does not work with multi_latent_attention (as in "
            "Megatron): DeepSeek's rotary channels have their own layout"
        )
    if config.qk_l2_norm and mla:
        raise ValueError("qk_l2_norm=True is not supported with multi_latent_attention")
    choice("qk_l2_norm_layers", config.qk_l2_norm_layers, ("all", "rope"))
    if config.qk_l2_norm_layers != "all" and not config.qk_l2_norm:
        raise ValueError(f"qk_l2_norm_layers={config.qk_l2_norm_layers!r} needs qk_l2_norm=True")
    _check_llama4_attention(config)
    if config.no_rope_freq is None:
        return
    if config.position_embedding_type not in ("rope", "yarn") or mla:
        raise ValueError(
            f"no_rope_freq={config.no_rope_freq!r} needs rotary embeddings "
            "(position_embedding_type 'rope' or 'yarn') without multi_latent_attention, got "
            f"position_embedding_type={config.position_embedding_type!r}"
            + (" with multi_latent_attention" if mla else "")
        )
    rope_layer_pattern(config)  # validates no_rope_freq


def _check_llama4_attention(config: TransformerConfig) -> None:
    chunk, floor = config.attention_chunk_size, config.attn_temperature_floor_scale
    rotary = config.position_embedding_type in ("rope", "yarn")
    if chunk is not None:
        positive("attention_chunk_size", chunk)
        if not rotary or config.multi_latent_attention:
            raise ValueError(
                f"attention_chunk_size={chunk} applies to the layers with rotary embeddings "
                "(position_embedding_type 'rope' or 'yarn', without multi_latent_attention), "
                f"got position_embedding_type={config.position_embedding_type!r}"
            )
        if config.window_size is not None:
            raise ValueError(
                f"attention_chunk_size={chunk} with window_size={config.window_size}: "
                "choose one way of limiting attention"
            )
    if floor is not None:
        positive("attn_temperature_floor_scale", floor)
        if config.no_rope_freq is None:
            raise ValueError(
                f"attn_temperature_floor_scale={floor} scales the queries of the layers "
                "without rotary embeddings: it needs no_rope_freq"
            )
    elif config.attn_temperature_scale != 0.1:
        raise ValueError(
            f"attn_temperature_scale={config.attn_temperature_scale} needs "
            "attn_temperature_floor_scale"
        )


def rope_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Per layer of the whole model (0-based index i): whether its attention applies the
    rotary embeddings. Megatron's rule for no_rope_freq on the 1-based layer number
    n = i + 1: for an integer N (dividing num_layers), every layer but those with
    n % N == 0; for a list, its value for layer n (1 = no rotary embeddings)."""
    n_layers, freq = config.num_layers, config.no_rope_freq
    if freq is None:
        return [True] * n_layers
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1 or n_layers % freq:
            raise ValueError(
                f"no_rope_freq={freq} must be a positive integer dividing num_layers={n_layers}"
            )
        return [(i + 1) % freq != 0 for i in range(n_layers)]
    pattern = list(freq)
    if len(pattern) != n_layers or any(x not in (0, 1) or isinstance(x, bool) for x in pattern):
        raise ValueError(
            f"no_rope_freq={freq!r} must be an integer or {n_layers} values (num_layers) of 0 or 1"
        )
    return [not x for x in pattern]


def qk_l2_norm_layer_pattern(config: TransformerConfig) -> list[bool]:
    """Per layer of the whole model: whether its queries and keys are L2-normalized
    (qk_l2_norm on every layer, or with qk_l2_norm_layers "rope" on the rotary ones)."""
    if not config.qk_l2_norm:
        return [False] * config.num_layers
    if config.qk_l2_norm_layers == "all":
        return [True] * config.num_layers
    return rope_layer_pattern(config)


def kv_heads_per_rank(config: TransformerConfig, tp: int) -> int:
    """The key/value heads (query groups) a tensor-parallel rank attends with: its
    num_query_groups / tp, or the one group it shares with tp / num_query_groups - 1 other
    ranks when the groups are fewer than the ranks (transformer/attention.py)."""
    groups = config.num_query_groups
    return groups // tp if groups >= tp else 1


def check_query_groups_parallel(config: TransformerConfig, tp: int) -> None:
    """num_query_groups split over tp ranks, or, when fewer, each group shared by tp / groups
    ranks (Megatron-LM's rule): each of them computes its share of the group's query heads
    and kv_channels / (tp / groups) of its key and value rows, then gathers the rest of its
    group's keys and values."""
    groups, d = config.num_query_groups, config.kv_channels
    if groups >= tp:
        if groups % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide num_query_groups={groups}"
            )
        return
    if tp % groups:
        raise ValueError(
            f"num_query_groups={groups} is fewer than tensor_model_parallel_size={tp} and does "
            f"not divide it: each group is shared by tensor_model_parallel_size / "
            "num_query_groups ranks"
        )
    share = tp // groups
    if d % share:
        raise ValueError(
            f"kv_channels={d}: the {share} tensor-parallel ranks sharing each of "
            f"num_query_groups={groups} hold kv_channels / {share} rows of its key and value "
            "heads each; use a tensor_model_parallel_size that makes that whole"
        )


def check_attention_parallel(config: TransformerConfig, tp: int, cp: int) -> None:
    """The attention rules that depend on the tensor- and context-parallel sizes. Sinks and
    windows across context-parallel ranks: "a2a" gathers whole sequences per head, the
    ring ("p2p") and "all_gather" mask their blocks of keys to the window (skipping those
    outside it) and add the sinks when the blocks are merged, and "a2a+p2p" does one, then
    the other."""
    if cp == 1:
        return
    comm = config.cp_comm_type
    if comm == "a2a" and kv_heads_per_rank(config, tp) % cp:
        raise ValueError(
            f"cp_comm_type='a2a' splits each tensor-parallel rank's "
            f"{kv_heads_per_rank(config, tp)} of num_query_groups={config.num_query_groups} "
            f"(tensor_model_parallel_size={tp}) over context_parallel_size={cp}, which does "
            "not divide it"
        )
    if comm == "a2a":
        return
    if config.tracks_max_attention_logit:
        raise ValueError(
            f"qk_clip / log_max_attention_logit with context parallelism (cp_comm_type="
            f"{comm!r}): the largest logit is taken over whole sequences; use "
            "cp_comm_type='a2a'"
        )
