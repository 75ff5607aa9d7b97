"""QkClipConfig: QK-clip (MuonClip's, Kimi K2; Megatron's --qk-clip, --qk-clip-alpha,
--qk-clip-threshold) and the max attention logit's log (--log-max-attention-logit), a
base of TransformerConfig.

During training each softmax attention layer keeps, per head, the largest attention
logit (q . k x the softmax scale, over the allowed pairs) its forward passes saw. After
the optimizer step (mp_train's loop, mp_layers.qk_clip), the layer's maxima are reduced
over the data- and context-parallel ranks; with qk_clip, each query group whose largest
logit m exceeds the threshold t gets eta = t / m: its query rows times eta ** alpha and
its key rows times eta ** (1 - alpha), so that its logits are multiplied by eta
(multi-latent attention: per head, the query's non-rotary rows times eta ** alpha and its
rotary rows times eta, the keys' non-rotary rows times eta ** (1 - alpha); the rotary key,
shared by the heads, is left alone). The log shows the largest logit of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["QkClipConfig", "check_qk_clip"]


@dataclass(kw_only=True)
class QkClipConfig:
    qk_clip: bool = False
    """QK-clip (MuonClip): after each optimizer step, the query and key weights of an
    attention group whose largest logit exceeded qk_clip_threshold are scaled down so that
    it would be the threshold (mp_layers.config_qk_clip); logs the largest logit too."""

    qk_clip_alpha: float = 0.5
    """The share of the scaling the queries take (the keys take the rest), in (0, 1)."""

    qk_clip_threshold: float = 100.0
    """The largest attention logit qk_clip allows, > 0."""

    log_max_attention_logit: bool = False
    """Log the largest attention logit of the model each iteration, without clipping."""

    @property
    def tracks_max_attention_logit(self) -> bool:
        """The attention layers keep their largest logits (qk_clip or its log)."""
        return self.qk_clip or self.log_max_attention_logit


def check_qk_clip(config: QkClipConfig) -> None:
    """Megatron's rules: alpha in (0, 1), a positive threshold; both need qk_clip."""
    alpha, threshold = config.qk_clip_alpha, config.qk_clip_threshold
    if not config.qk_clip:
        for name, value, default in (("qk_clip_alpha", alpha, 0.5),
                                     ("qk_clip_threshold", threshold, 100.0)):  # fmt: skip
            if value != default:
                raise ValueError(f"{name}={value} applies with qk_clip=True; set qk_clip or "
                                 "drop it")  # fmt: skip
        return
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"qk_clip_alpha={alpha} must be in (0, 1)")
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"qk_clip_threshold={threshold} must be finite and > 0")
