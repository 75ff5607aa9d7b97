"""TransformerConfig's multi-token prediction fields (MtpConfig, a base of it; Megatron's
--mtp-num-layers, --mtp-loss-scaling-factor, --mtp-use-repeated-layer) and their checks:
`check_mtp`, from __post_init__. Every message names the field and the value. `mtp_layer_kinds`
gives a module's layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_hybrid import HYBRID_SYMBOLS, split_hybrid_pattern
from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["MtpConfig", "check_mtp", "mtp_layer_kinds"]


@dataclass(kw_only=True)
class MtpConfig:
    """Multi-token prediction (Megatron's --mtp-num-layers, DeepSeek-V3): a base of
    TransformerConfig, checked by `check_mtp`."""

    mtp_num_layers: int | None = None
    """Multi-token prediction modules after the last layer (DeepSeek-V3 1): the k-th
    predicts the token k+1 positions ahead from the (k-1)-th's output and the embedding of
    the token k positions ahead, through its own norms, a projection and one transformer
    layer shaped as the model's last (in a hybrid model, the layers of the pattern's
    multi-token prediction part: hybrid_layer_pattern), and the shared output layer.
    Training only: their losses, scaled by mtp_loss_scaling_factor, add to the gradients;
    generation ignores them. On the last pipeline stage, which then holds a copy of the
    word embedding."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token prediction losses: each module's mean loss counts
    mtp_loss_scaling_factor / mtp_num_layers (Megatron's default 0.1)."""

    mtp_use_repeated_layer: bool = False
    """One multi-token prediction module applied mtp_num_layers times (Megatron's
    --mtp-use-repeated-layer): its weights are shared by every depth, each depth's loss
    logged and weighted as a module's; the checkpoint holds mtp.layers.0 alone."""

    mtp_detach_heads: bool = False
    """Train only the multi-token prediction modules with their losses (Megatron's
    --mtp-detach-heads): the decoder's output, the embedding of the rolled tokens and the
    output layer's weight reach the modules detached, so no MTP gradient flows into the
    rest of the model; the modules' parameters are tagged grad_norm_group "mtp", which
    mp-optim clips by their own gradient norm, apart from the reported one."""


def mtp_layer_kinds(config: TransformerConfig) -> list[tuple[str, bool]]:
    """(kind, whether a MoE layer) of each layer of one multi-token prediction module, kinds
    as mp_layers.hybrid_layer_kinds: a hybrid model's are its pattern's part after "/",
    otherwise one transformer layer shaped as the model's last."""
    pattern = config.hybrid_layer_pattern
    module = split_hybrid_pattern(pattern)[1] if pattern is not None else None
    if module is None:
        return [("transformer", config.moe_layer_pattern()[-1])]
    return [(HYBRID_SYMBOLS[symbol], symbol == "E") for symbol in module]


def check_mtp(config: TransformerConfig) -> None:
    n, factor = config.mtp_num_layers, config.mtp_loss_scaling_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"mtp_loss_scaling_factor={factor!r} must be a number")
    if not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"mtp_loss_scaling_factor={factor} must be finite and >= 0")
    if n is None:
        if config.mtp_use_repeated_layer:
            raise ValueError("mtp_use_repeated_layer=True repeats a multi-token prediction "
                             "module: it needs mtp_num_layers")  # fmt: skip
        if config.mtp_detach_heads:
            raise ValueError("mtp_detach_heads=True detaches the multi-token prediction "
                             "modules' inputs: it needs mtp_num_layers")  # fmt: skip
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"mtp_num_layers={n!r} must be an integer")
    positive("mtp_num_layers", n)
    position = config.position_embedding_type
    if position not in ("rope", "none"):
        raise ValueError(
            f"mtp_num_layers={n} with position_embedding_type={position!r}: multi-token "
            "prediction takes 'rope' or 'none' (Megatron-LM's rule; an MLA model's YaRN is "
            "rope_type='yarn' under 'rope')"
        )
