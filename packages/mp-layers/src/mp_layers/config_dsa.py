"""TransformerConfig's DeepSeek sparse attention fields (DsaConfig, a base of it; Megatron's
--experimental-attention-variant dsa and --dsa-*: DeepSeek-V3.2, GLM-5) and their checks:
`check_dsa`, from __post_init__, and `check_dsa_parallel`, from check_parallel; the
cross-layer sharing rule (`dsa_choice_source`, `shares_dsa_choice`) and its pipeline check
(`check_dsa_sources`, from GPTModel).

A model with experimental_attention_variant "dsa" has multi-latent attention in every
layer, each attending to the dsa_indexer_topk earlier positions a lightning indexer picks
for every query (transformer/sparse_attention.py): its own, or with dsa_indexer_topk_freq
an earlier layer's. Every message names the field and the value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mp_layers.config_rules import choice, left_default, positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = [
    "DsaConfig",
    "check_dsa",
    "check_dsa_parallel",
    "check_dsa_sources",
    "dsa_choice_source",
    "shares_dsa_choice",
    "uses_dsa",
]


@dataclass(kw_only=True)
class DsaConfig:
    """DeepSeek sparse attention (experimental_attention_variant "dsa"; Megatron's
    --dsa-* flags): a base of TransformerConfig, checked by `check_dsa`."""

    dsa_indexer_n_heads: int | None = None
    """The lightning indexer's heads (DeepSeek-V3.2: 64); needed with "dsa"."""

    dsa_indexer_head_dim: int | None = None
    """Channels of each indexer head and of its one key (DeepSeek-V3.2: 128), the first
    qk_pos_emb_head_dim of them rotated; needed with "dsa"."""

    dsa_indexer_topk: int | None = None
    """The earlier positions (the query's own included) each query attends to: those the
    indexer scores highest (DeepSeek-V3.2: 2048); needed with "dsa"."""

    dsa_indexer_topk_freq: int = 1
    """Cross-layer sharing of the chosen positions (Megatron's; GLM-5's "shared" indexer
    layers): with f > 1 and o = max(dsa_indexer_skip_topk_offset, 1), the layer of 1-based
    number L > o has an indexer when (L - o) is a multiple of f, and the others attend to
    the positions their last such layer (L - (L - o) mod f) chose, holding no indexer; the
    layers up to o each have their own. 1: every layer its own. Multi-token prediction
    modules number their layers 1, 2, ... apart (Megatron's): the first chooses for
    itself; a depth the rule would make reuse another's is refused."""

    dsa_indexer_skip_topk_offset: int = 0
    """The o of dsa_indexer_topk_freq's sharing: the layers up to it keep their indexers."""

    dsa_indexer_loss_coeff: float | None = None
    """The weight of the indexer's training loss: the KL divergence from the main
    attention's probabilities (summed over heads, normalized) to the indexer's softmax,
    per query, averaged. The indexer's inputs are detached, so that loss trains the
    indexer alone and the language-model loss never reaches it. None or 0: no loss (the
    indexer is not trained)."""

    dsa_indexer_use_sparse_loss: bool = False
    """Compute the indexer loss over the chosen positions only (both distributions
    renormalized over them), not over every earlier position."""

    dsa_kernel_backend: Literal["none", "tilelang", "cudnn"] = "none"
    """Megatron's fused DSA kernels; mp computes DSA with torch operations ("none"), and
    refuses the others naming them."""

    dsa_indexer_rope_interleaved: bool = False
    """Rotate the indexer's positional channels in interleaved pairs (2i, 2i + 1), as
    multi-latent attention does, instead of halves (DeepSeek-V3.2's indexer: halves)."""

    dsa_indexer_rotate_activation: bool = field(default=True, metadata={"argparse_meta": {
        "negatives": ["--disable-dsa-indexer-rotate-activation"]}})  # fmt: skip
    """Multiply the indexer's queries and key by an orthonormal Hadamard matrix before
    scoring (DeepSeek's, for its FP8 scoring): the scores are unchanged but for rounding.
    dsa_indexer_head_dim must then be a power of 2."""

    dsa_indexer_scoring_relu: bool = field(default=True, metadata={"argparse_meta": {
        "negatives": ["--disable-dsa-indexer-scoring-relu"]}})  # fmt: skip
    """ReLU on each indexer head's q . k before the heads' weighted sum (DeepSeek-V3.2's
    and GLM-5's indexers); off: the plain products."""

    dsa_indexer_k_norm_epsilon: float | None = None
    """The epsilon of the LayerNorm of the indexer's key; None: layernorm_epsilon."""

    dsa_indexer_k_norm_fp32: bool = False
    """Normalize the indexer's key in fp32 (then back to its dtype)."""


_DSA_ONLY = {
    "dsa_indexer_n_heads": None,
    "dsa_indexer_head_dim": None,
    "dsa_indexer_topk": None,
    "dsa_indexer_topk_freq": 1,
    "dsa_indexer_skip_topk_offset": 0,
    "dsa_indexer_loss_coeff": None,
    "dsa_indexer_use_sparse_loss": False,
    "dsa_kernel_backend": "none",
    "dsa_indexer_rope_interleaved": False,
    "dsa_indexer_rotate_activation": True,
    "dsa_indexer_scoring_relu": True,
    "dsa_indexer_k_norm_epsilon": None,
    "dsa_indexer_k_norm_fp32": False,
}
"""Fields that mean something only with experimental_attention_variant "dsa"."""


def uses_dsa(config: TransformerConfig) -> bool:
    return config.experimental_attention_variant == "dsa"


def check_dsa(config: TransformerConfig) -> None:
    if not uses_dsa(config):
        left_default(config, _DSA_ONLY, "experimental_attention_variant='dsa'")
        return
    if not config.multi_latent_attention:
        raise ValueError(
            "experimental_attention_variant='dsa' needs multi_latent_attention=True: the "
            "lightning indexer selects keys for multi-latent attention (Megatron's rule)"
        )
    for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        value = getattr(config, name)
        if value is None:
            raise ValueError(f"experimental_attention_variant='dsa' needs {name}")
        positive(name, value)
    choice("dsa_kernel_backend", config.dsa_kernel_backend, ("none", "tilelang", "cudnn"))
    if config.dsa_kernel_backend != "none":
        raise ValueError(
            f"dsa_kernel_backend={config.dsa_kernel_backend!r} needs Megatron's fused DSA "
            "kernels (TileLang or cuDNN), which mp does not use: leave it 'none'"
        )
    freq, offset = config.dsa_indexer_topk_freq, config.dsa_indexer_skip_topk_offset
    positive("dsa_indexer_topk_freq", freq)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"dsa_indexer_skip_topk_offset={offset!r} must be an integer >= 0")
    depths = config.mtp_num_layers or 0
    shared = [j + 1 for j in range(depths) if dsa_choice_source(config, j) != j]
    if freq > 1 and shared:  # Megatron numbers the MTP modules' layers 1, 2, ... apart
        raise ValueError(
            f"dsa_indexer_topk_freq={freq}, dsa_indexer_skip_topk_offset={offset} with "
            f"mtp_num_layers={depths}: multi-token prediction depth {shared[0]} would reuse "
            "an earlier depth's choice, which mp does not implement (each module's layer "
            "chooses its own positions)"
        )
    head_dim = config.dsa_indexer_head_dim
    if head_dim < config.qk_pos_emb_head_dim:
        raise ValueError(
            f"dsa_indexer_head_dim={head_dim} < qk_pos_emb_head_dim="
            f"{config.qk_pos_emb_head_dim}: the indexer rotates its first "
            "qk_pos_emb_head_dim channels"
        )
    if config.dsa_indexer_rotate_activation and head_dim & (head_dim - 1):
        raise ValueError(
            f"dsa_indexer_rotate_activation=True needs dsa_indexer_head_dim a power of 2 "
            f"(a Hadamard matrix of that size), got {head_dim}"
        )
    coeff, eps = config.dsa_indexer_loss_coeff, config.dsa_indexer_k_norm_epsilon
    if coeff is not None and not coeff >= 0:
        raise ValueError(f"dsa_indexer_loss_coeff={coeff} must be >= 0")
    if eps is not None and not eps > 0:
        raise ValueError(f"dsa_indexer_k_norm_epsilon={eps} must be > 0")
    refused = {
        "add_bias_linear": (config.add_bias_linear, "multi-latent attention with DSA has "
                            "no linear biases (Megatron's rule)"),
        "hybrid_layer_pattern": (config.hybrid_layer_pattern, "DSA layers in a hybrid "
                                 "pattern (Megatron's 'D') are not implemented"),
    }  # fmt: skip
    for name, (value, why) in refused.items():
        if value:
            raise ValueError(f"{name}={value!r} with experimental_attention_variant='dsa': "
                             f"{why}")  # fmt: skip


def shares_dsa_choice(config: TransformerConfig) -> bool:
    """Whether some layers reuse another layer's chosen positions (dsa_indexer_topk_freq)."""
    return uses_dsa(config) and config.dsa_indexer_topk_freq > 1


def dsa_choice_source(config: TransformerConfig, layer: int) -> int:
    """The 0-based number of the layer whose chosen positions the 0-based `layer` attends
    to: its own, or with dsa_indexer_topk_freq > 1 its source's (Megatron's rule, the
    field's docstring)."""
    freq, offset = config.dsa_indexer_topk_freq, max(config.dsa_indexer_skip_topk_offset, 1)
    number = layer + 1
    if freq == 1 or number <= offset:
        return layer
    return number - (number - offset) % freq - 1


def check_dsa_sources(config: TransformerConfig, layers: list[int]) -> None:
    """A model chunk of these 0-based layers holds each source its layers reuse (Megatron's
    rule: a pipeline stage, or virtual chunk, starts on a layer with an indexer)."""
    held = set(layers)
    for layer in layers:
        source = dsa_choice_source(config, layer)
        if source not in held:
            raise ValueError(
                f"layer {layer + 1} reuses the positions layer {source + 1} chooses "
                f"(dsa_indexer_topk_freq={config.dsa_indexer_topk_freq}, "
                f"dsa_indexer_skip_topk_offset={config.dsa_indexer_skip_topk_offset}), "
                "which another pipeline stage holds: split the stages so that each starts "
                "on a layer with an indexer"
            )


def check_dsa_parallel(config: TransformerConfig, cp: int) -> None:
    """Tensor, pipeline and context parallelism as for multi-latent attention (the
    indexer is replicated on the tensor-parallel ranks; under context parallelism each
    rank's queries attend to the gathered keys, whatever cp_comm_type says). The largest
    attention logit is not tracked there (qk_clip, log_max_attention_logit: refused)."""
    if uses_dsa(config) and cp > 1 and config.tracks_max_attention_logit:
        raise ValueError(
            f"context_parallel_size={cp} with experimental_attention_variant='dsa' and "
            "qk_clip or log_max_attention_logit: the sparse attention's largest logits are "
            "not tracked under context parallelism"
        )
