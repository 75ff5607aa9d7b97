"""MupConfig: Maximal Update Parameterization (muP; Megatron's --use-mup and --mup-* flags)
and the embedding's initialization (--embedding-init-method-std), a base of TransformerConfig.

muP makes a model's best hyper-parameters (learning rate, initialization, multipliers)
hold across widths: tune a narrow proxy of width mup_base_hidden_size, then train the
wide model with the same flags. Its rules, with m = hidden_size / mup_base_hidden_size
(Megatron-LM's):
- initialization: the hidden matrices (attention, MLP, experts, routers, Mamba and
  DeltaNet projections, the MTP projections) normal(init_method_std / sqrt(m)); the
  projections into the residual normal(init_method_std / sqrt(2 layers m)); the
  embeddings, and an untied output layer, normal(embedding_init_method_std) unscaled;
- forward: the embedding's output times mup_embedding_mult; the logits (the language
  model's and each multi-token prediction head's) times mup_output_mult, 1 / m unless
  set; softmax attention's scale sqrt(mup_base_head_dim) / kv_channels **
  mup_attn_scale_power (1 / kv_channels by default) instead of 1 / sqrt(kv_channels);
  multi-latent attention keeps its own scale, as in Megatron;
- optimizer (mp_optim.get_param_groups, given m): under Adam the hidden matrices' lr
  (both ends of its schedule) and eps divided by m; under SGD the vector-like
  parameters' (embeddings, output layer, norms, biases) lr times m; under Muon the
  matrices Adam steps get lr / m and Muon's own keep theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MupConfig", "check_mup"]


@dataclass(kw_only=True)
class MupConfig:
    use_mup: bool = False
    """Maximal Update Parameterization: initialization, the embedding's and the logits'
    multipliers, the attention scale and the hidden matrices' learning rate and Adam eps
    follow the width multiplier hidden_size / mup_base_hidden_size (mp_layers.config_mup
    lists the rules), so that hyper-parameters tuned at the base width transfer."""

    mup_base_hidden_size: int | None = None
    """The width the hyper-parameters were tuned at (the proxy model's hidden size); None:
    hidden_size (a width multiplier of 1). Needs use_mup."""

    mup_embedding_mult: float = 1.0
    """Multiplier of the embedding's output. Needs use_mup."""

    mup_output_mult: float = 1.0
    """Multiplier of the logits; 1.0: 1 / the width multiplier. Needs use_mup."""

    mup_base_head_dim: float | None = None
    """With use_mup, softmax attention's scale is sqrt(mup_base_head_dim) / kv_channels **
    mup_attn_scale_power (None: 1 / kv_channels ** mup_attn_scale_power); set it to the base
    model's head width to keep 1 / sqrt(head width) there. Needs use_mup."""

    mup_attn_scale_power: float = 1.0
    """The power of kv_channels in the muP attention scale: 1.0 muP's 1 / head width, 0.5
    the standard 1 / sqrt(head width). Needs use_mup."""

    embedding_init_method_std: float | None = None
    """Standard deviation of the word and position embeddings' normal initialization (and,
    with use_mup, of an untied output layer's); None: init_method_std."""

    @property
    def mup_width_mult(self) -> float:
        """hidden_size / mup_base_hidden_size with use_mup, else 1."""
        if not self.use_mup or self.mup_base_hidden_size is None:
            return 1.0
        return self.hidden_size / self.mup_base_hidden_size

    @property
    def logit_multiplier(self) -> float:
        """What the logits are multiplied by: mup_output_mult, 1 / the width multiplier when
        left at 1.0 (Megatron's rule); without use_mup 1 / logits_scaling (Granite's)."""
        if not self.use_mup:
            return 1.0 / self.logits_scaling
        if self.mup_output_mult == 1.0:
            return 1.0 / self.mup_width_mult
        return self.mup_output_mult

    @property
    def embedding_multiplier(self) -> float:
        """What the embedding's output is multiplied by: mup_embedding_mult with use_mup,
        else word_embedding_multiplier (Granite's)."""
        return self.mup_embedding_mult if self.use_mup else self.word_embedding_multiplier

    @property
    def softmax_scale(self) -> float | None:
        """Softmax attention's scale of q k^T under use_mup, or 1 / sqrt(query_pre_attn_scalar)
        (Gemma's); None: 1 / sqrt(kv_channels)."""
        if not self.use_mup:
            scalar = self.query_pre_attn_scalar
            return None if scalar is None else scalar**-0.5
        base = 1.0 if self.mup_base_head_dim is None else math.sqrt(self.mup_base_head_dim)
        return base / self.kv_channels**self.mup_attn_scale_power

    @property
    def hidden_init_std(self) -> float:
        """The normal initialization's std of the hidden matrices: init_method_std, divided
        by sqrt(the width multiplier) under use_mup."""
        return self.init_method_std / math.sqrt(self.mup_width_mult)

    @property
    def embedding_init_std(self) -> float:
        """The embeddings' initialization std: embedding_init_method_std or init_method_std."""
        std = self.embedding_init_method_std
        return self.init_method_std if std is None else std

    @property
    def output_layer_init_std(self) -> float:
        """Megatron's scaled init of the projections into the residual: std / sqrt(2 *
        layers) (a hybrid model's: std / sqrt(layers), as Megatron's is_hybrid_model),
        divided by sqrt(the width multiplier) under use_mup."""
        depth = self.num_layers * (1.0 if self.hybrid_layer_pattern is not None else 2.0)
        return self.init_method_std / math.sqrt(depth * self.mup_width_mult)


def check_mup(config: MupConfig) -> None:
    """The muP fields: positive sizes and multipliers; set without use_mup, refused (they
    would do nothing)."""
    std = config.embedding_init_method_std
    if std is not None and not (isinstance(std, (int, float)) and std > 0):
        raise ValueError(f"embedding_init_method_std={std!r} must be > 0")
    defaults = {"mup_base_hidden_size": None, "mup_embedding_mult": 1.0,
                "mup_output_mult": 1.0, "mup_base_head_dim": None,
                "mup_attn_scale_power": 1.0}  # fmt: skip
    if not config.use_mup:
        for name, default in defaults.items():
            if getattr(config, name) != default:
                raise ValueError(f"{name}={getattr(config, name)!r} applies with "
                                 "use_mup=True (Maximal Update Parameterization); set "
                                 "use_mup or drop it")  # fmt: skip
        return
    base = config.mup_base_hidden_size
    if base is not None and (isinstance(base, bool) or not isinstance(base, int) or base < 1):
        raise ValueError(f"mup_base_hidden_size={base!r} must be a positive integer")
    for name in ("mup_embedding_mult", "mup_output_mult", "mup_base_head_dim"):
        value = getattr(config, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be finite and > 0")
    if not math.isfinite(config.mup_attn_scale_power):
        raise ValueError(f"mup_attn_scale_power={config.mup_attn_scale_power!r} must be finite")
