"""TransformerConfig's multi-latent attention fields (MlaConfig, a base of it; Megatron's
--multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim,
--qk-pos-emb-head-dim, --v-head-dim and --rope-type) and their checks:
`check_mla`, from __post_init__.
The tensor- and context-parallel rules of MLA are those of standard attention (the heads
divide over the tensor-parallel ranks; check_parallel). Every message names the field and
the value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_rules import choice, left_default, positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["MlaConfig", "check_mla"]


@dataclass(kw_only=True)
class MlaConfig:
    """Multi-latent attention (Megatron's --multi-latent-attention and MLA options): a
    base of TransformerConfig, checked by `check_mla`."""

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2; Megatron's MLASelfAttention): queries
    from a latent of q_lora_rank channels, keys and values from a shared latent of
    kv_lora_rank channels (all a KVCache keeps), each head's query and key a
    qk_head_dim part and a rotated qk_pos_emb_head_dim part whose key is shared by all
    heads, values of v_head_dim. It rotates whatever position_embedding_type is (rope_type
    picks YaRN, the default, or plain RoPE), as Megatron's MLA does: "learned_absolute"
    (Megatron's default) adds the learned table at the input as well. No query groups,
    sinks, windows or QKV bias."""

    q_lora_rank: int | None = None
    """MLA: channels of the query latent (linear_q_down_proj, q_layernorm,
    linear_q_up_proj; DeepSeek-V3 1536); None: queries projected from the hidden state
    at once (linear_q_proj; DeepSeek-V2-Lite)."""

    kv_lora_rank: int = 32
    """MLA: channels of the key/value latent (DeepSeek 512)."""

    qk_head_dim: int = 128
    """MLA: query and key channels per head without rotary embeddings."""

    qk_pos_emb_head_dim: int = 64
    """MLA: rotary channels per head of the queries and of the one key all heads share."""

    v_head_dim: int = 128
    """MLA: value channels per head."""

    latent_norm_epsilon: float | None = None
    """MLA: the epsilon of the latent norms (q_layernorm, kv_layernorm); None:
    layernorm_epsilon, as Megatron-LM has one epsilon. Not a Megatron setting:
    transformers' DeepSeek and GLM models normalize the latents with 1e-6 whatever their
    rms_norm_eps says (GLM-5's is 1e-5), which mp-ckpt's import sets here."""


_MLA_ONLY = {
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "latent_norm_epsilon": None,
}
"""Fields that mean something only with multi_latent_attention (Megatron's defaults)."""

_NOT_WITH_MLA = {
    "use_rope_scaling": False,
    "rotary_seq_len_interpolation_factor": None,
    "rotary_percent": 1.0,
    "add_qkv_bias": False,
    "softmax_type": "vanilla",
    "window_size": None,
}
"""Standard attention's options that mp's MLA does not implement (no MLA model uses them):
refused with multi_latent_attention."""


def check_mla(config: TransformerConfig) -> None:
    rope_type = config.rope_type
    if rope_type is not None:
        choice("rope_type", rope_type, ("rope", "yarn"))
    if not config.multi_latent_attention:
        left_default(config, _MLA_ONLY, "multi_latent_attention")
        if rope_type is not None and config.position_embedding_type not in ("rope", "yarn"):
            raise ValueError(
                f"rope_type={rope_type!r} chooses multi-latent attention's rotary embeddings; "
                "standard attention takes position_embedding_type='rope' (with rope_type "
                f"'rope') or 'yarn', got position_embedding_type="
                f"{config.position_embedding_type!r}"
            )
        if rope_type == "yarn":
            raise ValueError(
                "rope_type='yarn' applies to multi-latent attention; for YaRN in standard "
                "attention set position_embedding_type='yarn'"
            )
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        positive(name, getattr(config, name))
    if config.attention_output_gate:
        raise ValueError("attention_output_gate=True with multi_latent_attention: "
                         "multi-latent attention has no output gate (Megatron-LM refuses "
                         "the pair too)")  # fmt: skip
    if config.q_lora_rank is not None:
        positive("q_lora_rank", config.q_lora_rank)
    eps = config.latent_norm_epsilon
    if eps is not None and not (isinstance(eps, float | int) and eps > 0):
        raise ValueError(f"latent_norm_epsilon={eps!r} must be > 0")
    if config.qk_pos_emb_head_dim % 2:
        raise ValueError(
            f"qk_pos_emb_head_dim={config.qk_pos_emb_head_dim} must be even: rotary "
            "embeddings turn its channels in pairs"
        )
    if config.num_query_groups != config.num_attention_heads:
        raise ValueError(
            f"num_query_groups={config.num_query_groups} with multi_latent_attention: MLA has "
            f"no query groups (each of the num_attention_heads={config.num_attention_heads} "
            "heads has its own key and value); leave num_query_groups unset"
        )
    # MLA rotates its qk_pos_emb_head_dim channels whatever position_embedding_type is;
    # "learned_absolute" (Megatron's default) adds the learned table at the input too.
    if config.position_embedding_type == "yarn" and rope_type == "rope":
        raise ValueError(
            "position_embedding_type='yarn' and rope_type='rope' disagree: give one of them"
        )
    for name, default in _NOT_WITH_MLA.items():
        value = getattr(config, name)
        if value != default:
            raise ValueError(
                f"{name}={value!r} is not implemented with multi_latent_attention (no MLA "
                f"model uses it); leave it at {default!r}"
            )
