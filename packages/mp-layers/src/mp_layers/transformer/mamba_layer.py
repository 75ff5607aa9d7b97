"""MambaLayer: a hybrid model's M layer (Megatron's MambaLayer), x + dropout(mixer(norm(x))),
the mixer's part times residual_multiplier where it is not 1 (Granite 4's).

Shapes as TransformerLayer's: x [s, b, h], or [s/tp, b, h] with sequence parallelism. The
mixer (mamba_mixer.py) runs over whole sequences, each document of packed samples on its
own (an attention_mask that is a PackedSeqParams), or with a KVCache over the next
positions from the states it keeps.
"""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import replicated_state_dict
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.mamba_mixer import MambaMixer
from mp_layers.transformer.packed import PackedSeqParams
from mp_layers.transformer.residual import check_dropout_stream, hidden_dropout
from mp_layers.transformer.rope import Rotary
from mp_layers.transformer.spec import LOCAL_SPEC, LayerSpec
from mp_state import RNGStatesTracker

__all__ = ["MambaLayer"]


class MambaLayer(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        spec: LayerSpec = LOCAL_SPEC,
        layer_number: int = 0,
    ) -> None:
        super().__init__()
        check_dropout_stream(config, rng_tracker)
        self.config = config
        self.rng_tracker = rng_tracker
        self.tp_group = groups.tp
        self.layer_number = layer_number
        self.norm = spec.norm(config, None)
        self.mixer = MambaMixer(config, groups)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """rotary and a causal attention_mask do not concern the mixer (it is causal; with a
        kv_cache the cache says which slots are padding); a PackedSeqParams gives it the
        documents."""
        packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
        out, bias = self.mixer(self.norm(x), kv_cache, self.layer_number, packed)
        out = out if bias is None else out + bias
        out = hidden_dropout(self.config, self.rng_tracker, out, self.training)
        multiplier = self.config.residual_multiplier
        return x + (out if multiplier == 1.0 else out * multiplier)

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = self.mixer.sharded_state_dict(f"{prefix}mixer.")
        return pieces | replicated_state_dict(self.norm, f"{prefix}norm.", self.tp_group)
