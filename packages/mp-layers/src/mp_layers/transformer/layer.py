"""TransformerLayer and TransformerBlock: the residual layers of one pipeline stage.

Shapes: x [s, b, h], or [s/tp, b, h] with sequence parallelism (then norms,
dropout and residual adds run on each rank's slice of the sequence).

    x = x + dropout(attention(norm(x)))
    x = x + dropout(mlp(norm(x)))

with TransformerConfig.sublayer_norm "input" (pre-norm). "output" normalizes each
sublayer's output instead (post_self_attn_layernorm, post_mlp_layernorm: OLMo 2),
x = x + dropout(norm(attention(x))), and "both" normalizes input and output (Gemma's
sandwich), x = x + dropout(norm(attention(norm(x)))). Selective "layernorm" recompute
covers the input norms. With residual_multiplier m (Granite's) each sublayer's output
joins the residual as m dropout(...).

Hidden dropout: residual.py. In a hybrid model (TransformerConfig.hybrid_layer_pattern)
a layer has one sublayer: attention (*), a gated DeltaNet (G), a dense MLP (-) or a MoE MLP
(E) with its norm, or a Mamba mixer (M: mamba_layer.py, built here by the block). With
experimental_attention_variant the attention of the linear_attention_freq layers is a gated
DeltaNet (gated_delta_net.py).
"""

from __future__ import annotations

import torch

from mp_ckpt import ShardedTensor
from mp_layers.config import TransformerConfig
from mp_layers.config_hybrid import hybrid_layer_kinds
from mp_layers.config_linear_attention import linear_attention_layer_pattern
from mp_layers.fp8 import apply_fp8
from mp_layers.groups import ModelGroups
from mp_layers.tensor_parallel import replicated_state_dict
from mp_layers.transformer.kv_cache import KVCache
from mp_layers.transformer.layer_hooks import building_layer, layer_built
from mp_layers.transformer.mamba_layer import MambaLayer
from mp_layers.transformer.output_recompute import OutputRecompute
from mp_layers.transformer.recompute import checkpointed
from mp_layers.transformer.residual import check_dropout_stream, hidden_dropout
from mp_layers.transformer.rope import Rotary
from mp_layers.transformer.seeded_init import seeded_init
from mp_layers.transformer.spec import LOCAL_SPEC, LayerSpec
from mp_state import RNGStatesTracker

__all__ = ["TransformerBlock", "TransformerLayer"]


class TransformerLayer(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        spec: LayerSpec = LOCAL_SPEC,
        layer_number: int = 0,
        kind: str | None = None,
    ) -> None:
        """layer_number: the layer's index in the whole model (which layers are MoE); kind:
        a hybrid layer's kind when it is not the decoder layer's ("attention", "gdn", "mlp"
        or "moe": a multi-token prediction module's layer)."""
        super().__init__()
        check_dropout_stream(config, rng_tracker)
        self.config = config
        self.rng_tracker = rng_tracker
        self.tp_group = groups.tp
        self.layer_number = layer_number
        is_moe = config.moe_layer_pattern()[layer_number] if kind is None else kind == "moe"
        # the pattern's (a multi-token prediction module's layer is shaped as the last's)
        linear = kind is None and linear_attention_layer_pattern(config)[layer_number]
        kind = hybrid_layer_kinds(config)[layer_number] if kind is None else kind
        self.input_layernorm = self.self_attention = self.pre_mlp_layernorm = self.mlp = None
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if kind == "gdn":  # a hybrid model's G layer: a gated DeltaNet and its norm
            self.input_layernorm = spec.norm(config, None)
            self.self_attention = spec.linear_attention(
                config, groups, rng_tracker, spec=spec, layer_number=layer_number
            )
        normed_in = config.sublayer_norm != "output"
        normed_out = config.sublayer_norm != "input"
        if kind in ("transformer", "attention"):
            self.input_layernorm = spec.norm(config, None) if normed_in else None
            self.post_self_attn_layernorm = spec.norm(config, None) if normed_out else None
            attention = (
                spec.multi_latent_attention if config.multi_latent_attention
                else spec.linear_attention if linear and kind == "transformer"
                else spec.self_attention
            )  # fmt: skip
            self.self_attention = attention(
                config, groups, rng_tracker, spec=spec, layer_number=layer_number
            )
        if kind in ("transformer", "mlp", "moe"):
            self.pre_mlp_layernorm = spec.norm(config, None) if normed_in else None
            self.post_mlp_layernorm = spec.norm(config, None) if normed_out else None
            self.mlp = (spec.moe(config, groups, rng_tracker) if is_moe
                        else spec.mlp(config, groups.tp))  # fmt: skip
        # Megatron's --moe-layer-recompute; a full recompute reruns the whole layer already.
        # and selective recompute's "mlp" and "moe" (recompute_modules)
        moe_recompute = config.moe_layer_recompute or config.recomputes("moe")
        self.recompute_mlp = config.recompute_granularity != "full" and (
            (is_moe and moe_recompute) or (not is_moe and config.recomputes("mlp"))
        )
        # selective "layernorm": both norms' outputs discarded once attention and the MLP
        # saved them (output_recompute.py)
        self.recompute_norms = config.recomputes("layernorm")

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        norms = self.recompute_norms and self.training
        if self.self_attention is not None:
            kept = OutputRecompute(norms and self.input_layernorm is not None)
            normed = _norm(kept, self.input_layernorm, x)
            out, bias = self.self_attention(normed, rotary, attention_mask, kv_cache)
            kept.discard(out)
            x = x + self._to_residual(self._output(out, bias, self.post_self_attn_layernorm))
        if self.mlp is None:
            return x
        kept = OutputRecompute(norms and self.pre_mlp_layernorm is not None)
        mlp_input = _norm(kept, self.pre_mlp_layernorm, x)
        chunks = min(self.config.mlp_chunks_for_training, mlp_input.shape[0])
        if self.recompute_mlp and self.training and torch.is_grad_enabled():
            out, bias = checkpointed(self.mlp, self.rng_tracker, mlp_input)
        elif chunks > 1 and self.training:  # a piece of the sequence at a time (position-wise)
            outs = [self.mlp(piece) for piece in mlp_input.chunk(chunks, dim=0)]
            out, bias = torch.cat([o for o, _ in outs]), outs[0][1]
        else:
            out, bias = self.mlp(mlp_input)
        kept.discard(out)
        return x + self._to_residual(self._output(out, bias, self.post_mlp_layernorm))

    @staticmethod
    def _output(out: torch.Tensor, bias: torch.Tensor | None, norm) -> torch.Tensor:
        """A sublayer's output with its bias, normalized where sublayer_norm says."""
        out = out if bias is None else out + bias
        return out if norm is None else norm(out)

    def _to_residual(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output after hidden dropout, times residual_multiplier (Granite's)."""
        x = hidden_dropout(self.config, self.rng_tracker, x, self.training)
        multiplier = self.config.residual_multiplier
        return x if multiplier == 1.0 else x * multiplier

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        pieces = {}
        for name in ("self_attention", "mlp"):
            if getattr(self, name) is not None:
                pieces |= getattr(self, name).sharded_state_dict(f"{prefix}{name}.")
        for norm_name in ("input_layernorm", "post_self_attn_layernorm", "pre_mlp_layernorm",
                          "post_mlp_layernorm"):  # fmt: skip
            if getattr(self, norm_name) is not None:
                pieces |= replicated_state_dict(
                    getattr(self, norm_name), f"{prefix}{norm_name}.", self.tp_group
                )
        return pieces


def _norm(kept: OutputRecompute, norm: torch.nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """A sublayer's input: x normalized (recomputable), or x itself without an input norm
    (then `kept`, built inactive, has nothing to discard)."""
    return x if norm is None else kept.run(norm, x)


class TransformerBlock(torch.nn.Module):
    """The layers [layer_offset, layer_offset + num_layers) of the model, and the final norm."""

    def __init__(
        self,
        config: TransformerConfig,
        groups: ModelGroups,
        rng_tracker: RNGStatesTracker | None = None,
        *,
        spec: LayerSpec = LOCAL_SPEC,
        layer_offset: int = 0,
        num_layers: int | None = None,
        post_process: bool = True,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        count = config.num_layers - layer_offset if num_layers is None else num_layers
        if layer_offset < 0 or count < 0 or layer_offset + count > config.num_layers:
            raise ValueError(
                f"layers {layer_offset}..{layer_offset + count} are outside the model's "
                f"num_layers={config.num_layers}"
            )
        self.layer_offset = layer_offset
        self.tp_group = groups.tp
        self.rng_tracker = rng_tracker
        self.recompute_method = (
            config.recompute_method if config.recompute_granularity == "full" else None
        )
        self.recompute_num_layers = config.recompute_num_layers
        layers = []
        kinds = hybrid_layer_kinds(config)
        for i in range(count):
            cls = MambaLayer if kinds[layer_offset + i] == "mamba" else TransformerLayer
            with seeded_init(init_seed, f"layer{layer_offset + i}"), building_layer():
                layer = cls(config, groups, rng_tracker, spec, layer_offset + i)
            layers.append(layer_built(layer))
        self.layers = torch.nn.ModuleList(layers)
        self.fp8_linear_layers = apply_fp8(self.layers, config, layer_offset) if config.fp8 else 0
        self.final_layernorm = spec.norm(config, None) if post_process else None

    def forward(self, x, rotary=None, attention_mask=None, kv_cache=None) -> torch.Tensor:
        if kv_cache is not None:  # generation: no backward, nothing to recompute
            for layer in self.layers:
                x = layer(x, rotary, attention_mask, kv_cache)
            return self.final_layernorm(x) if self.final_layernorm is not None else x
        recompute = self.recompute_method if self.training and torch.is_grad_enabled() else None
        n = len(self.layers)
        if recompute == "uniform":
            # Groups of recompute_num_layers layers: only each group's input is kept.
            for start in range(0, n, self.recompute_num_layers):
                group = self.layers[start : start + self.recompute_num_layers]
                x = checkpointed(_run_layers, self.rng_tracker, group, x, rotary, attention_mask)
        else:
            # "block": the first recompute_num_layers layers of the stage, one at a time.
            recomputed = self.recompute_num_layers if recompute == "block" else 0
            for i, layer in enumerate(self.layers):
                if i < recomputed:
                    x = checkpointed(layer, self.rng_tracker, x, rotary, attention_mask)
                else:
                    x = layer(x, rotary, attention_mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """Layers under their global numbers, so that pipeline stages compose."""
        pieces: dict[str, ShardedTensor] = {}
        for i, layer in enumerate(self.layers):
            pieces |= layer.sharded_state_dict(f"{prefix}layers.{self.layer_offset + i}.")
        if self.final_layernorm is not None:
            pieces |= replicated_state_dict(
                self.final_layernorm, f"{prefix}final_layernorm.", self.tp_group
            )
        return pieces


def _run_layers(layers, x, rotary, attention_mask) -> torch.Tensor:
    for layer in layers:
        x = layer(x, rotary, attention_mask)
    return x
