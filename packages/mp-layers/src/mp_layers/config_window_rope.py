"""TransformerConfig's rotary embeddings of the windowed layers (WindowRopeConfig, a base of
it; mp's field, not Megatron-LM's) and their check: `check_window_rope`, from
__post_init__. Every message names the field and the value.

Gemma 3 rotates its sliding-window layers with a base of their own (rope_local_base_freq,
10,000 beside the full layers' 1,000,000 and their linear scaling), OLMo 3 its sliding
layers without the YaRN scaling its full layers take: the layers window_layer_pattern
marks then take plain RoPE of window_rotary_base (same rotary_percent, same channel
pairs), the others the model's rotary embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp_layers.config_rules import positive

if TYPE_CHECKING:
    from mp_layers.config import TransformerConfig

__all__ = ["WindowRopeConfig", "check_window_rope"]


@dataclass(kw_only=True)
class WindowRopeConfig:
    window_rotary_base: int | None = None
    """The rotary base of the layers that attend through window_size (window_layer_pattern),
    with plain RoPE: none of the scaling (use_rope_scaling, YaRN,
    rotary_seq_len_interpolation_factor) of the other layers' rotary embeddings (Gemma 3's
    rope_local_base_freq; OLMo 3's sliding layers). None: every layer rotates alike."""


def check_window_rope(config: TransformerConfig) -> None:
    base = config.window_rotary_base
    if base is None:
        return
    positive("window_rotary_base", base)
    if config.window_size is None:
        raise ValueError(f"window_rotary_base={base} needs window_size (the layers it rotates)")
    if config.position_embedding_type not in ("rope", "yarn") or config.multi_latent_attention:
        raise ValueError(
            f"window_rotary_base={base} needs position_embedding_type 'rope' or 'yarn' "
            f"without multi_latent_attention, got {config.position_embedding_type!r}"
        )
