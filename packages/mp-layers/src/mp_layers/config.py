"""TransformerConfig: the shape and numerics of a GPT model, with Megatron's field names.

Rules that hold whatever the layout are checked in __post_init__; those that
depend on the tensor-parallel size in `check_parallel`. Every message names
the field and the value. The fields of mixture of experts, multi-latent attention,
linear attention, DeepSeek sparse attention, multi-token prediction, Mamba-hybrid models,
FP8, muP, QK-clip, norm placement, the windowed layers' rotary base and Gemma's scales
are in its bases (MoeConfig, ...), each in the config_*.py module that checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from mp_layers.config_attention import (
    check_attention_fields,
    check_attention_parallel,
    check_query_groups_parallel,
)
from mp_layers.config_dsa import DsaConfig, check_dsa, check_dsa_parallel
from mp_layers.config_fp8 import Fp8Config, check_fp8
from mp_layers.config_hybrid import (
    HybridConfig,
    check_hybrid,
    check_hybrid_parallel,
    infer_hybrid_mtp,
    split_hybrid_pattern,
)
from mp_layers.config_linear_attention import (
    LinearAttentionConfig,
    check_linear_attention,
    check_linear_attention_parallel,
)
from mp_layers.config_mla import MlaConfig, check_mla
from mp_layers.config_moe import MoeConfig, check_expert_parallel, check_moe
from mp_layers.config_mtp import MtpConfig, check_mtp
from mp_layers.config_mup import MupConfig, check_mup
from mp_layers.config_norms import (
    NormPlacementConfig,
    check_norm_placement,
    check_norm_placement_parallel,
)
from mp_layers.config_qk_clip import QkClipConfig, check_qk_clip
from mp_layers.config_query_scale import QueryScaleConfig, check_query_scale
from mp_layers.config_recompute import (
    apply_moe_layer_recompute,
    check_recompute,
    check_recompute_modules,
)
from mp_layers.config_rules import choice as _choice
from mp_layers.config_rules import positive as _positive
from mp_layers.config_scales import ScalesConfig, check_scales
from mp_layers.config_window_rope import WindowRopeConfig, check_window_rope

__all__ = ["ATTENTION_BACKENDS", "TransformerConfig"]

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron's --attention-backend choices; mp_layers.transformer.core_attention maps them."""


@dataclass(kw_only=True)
class TransformerConfig(
    MoeConfig,
    MlaConfig,
    LinearAttentionConfig,
    DsaConfig,
    MtpConfig,
    HybridConfig,
    Fp8Config,
    MupConfig,
    QkClipConfig,
    NormPlacementConfig,
    WindowRopeConfig,
    ScalesConfig,
    QueryScaleConfig,
):
    num_layers: int
    """Transformer layers of the whole model (all pipeline stages)."""

    hidden_size: int
    """Width of the residual stream (h)."""

    num_attention_heads: int
    """Query heads per layer."""

    ffn_hidden_size: int | None = None
    """MLP inner width; None: 4 * hidden_size, or Megatron's swiglu default
    int(4 * hidden_size * 2 / 3 / 64) * 64."""

    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None: num_attention_heads (MHA). Split
    over the tensor-parallel ranks, or, when fewer than them, each shared by tp /
    num_query_groups ranks (tp a multiple of it, as in Megatron-LM)."""

    kv_channels: int | None = None
    """Width of each attention head; None: hidden_size / num_attention_heads. Unused with
    multi_latent_attention, whose widths are qk_head_dim, qk_pos_emb_head_dim and v_head_dim
    (Megatron ignores it there too)."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization of each sublayer's input and of the final output."""

    apply_layernorm_1p: bool = False
    """Zero-centered gamma (Megatron's --apply-layernorm-1p, its config's
    layernorm_zero_centered_gamma; Nemotron's LayerNorm1P): every norm (the layers', the
    final one, the QK norms) stores w and scales by 1 + w, y = norm(x) (1 + w) + b, w
    initialized to 0. With LayerNorm or RMSNorm (no b)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""

    activation: Literal["gelu", "swiglu", "geglu", "squared_relu"] = "gelu"
    """MLP activation; swiglu and geglu gate with a second fc1 half (fused): silu(g) u and
    gelu(g) u (Gemma's gated GELU, mp's; Megatron-LM's flags have no gated GELU)."""

    openai_gelu: bool = False
    """With activation="gelu" or "geglu": the tanh approximation
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of GPT-2 (Hugging Face's gelu_new,
    gelu_pytorch_tanh) instead of the exact x Phi(x) (Megatron's --openai-gelu)."""

    quick_geglu: bool = False
    """Instead of activation="gelu": the gated quick GELU of gpt-oss (Megatron's
    --quick-geglu): fc1 gives a gate g and a linear part u (twice as wide, as for swiglu)
    and the MLP computes g sigmoid(1.702 g) (u + glu_linear_offset), after
    activation_func_clamp_value's clamp."""

    glu_linear_offset: float = 0.0
    """Added to the linear part u of a gated activation (swiglu, quick_geglu) before the
    product: act(g) (u + offset); gpt-oss uses 1 (Megatron's --glu-linear-offset)."""

    activation_func_clamp_value: float | None = None
    """A gated activation's inputs clamped before it (Megatron's
    --activation-func-clamp-value): the gate g to at most the value, the linear part u to
    [-value, value]; gpt-oss uses 7. With swiglu only in MoE models, as in Megatron.
    None: no clamp."""

    add_bias_linear: bool = True
    """Biases in every linear layer: attention's, the MLP's, and in MoE layers the router's
    (logits x w^T + b) and each routed expert's fc1 and fc2 (the shared expert has none:
    refused, as in Megatron)."""

    add_qkv_bias: bool = False
    """A bias in the QKV projection even without add_bias_linear (Qwen-style)."""

    hidden_dropout: float = 0.1
    """Dropout after attention and MLP, before the residual add."""

    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""

    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """Core attention: "flash" or "fused" run torch's scaled_dot_product_attention
    (a flash or memory-efficient kernel on CUDA, the flash kernel on CPUs); "local" or
    "unfused" write the probabilities out, a block of 256 query positions at a time,
    skipping the blocks above the causal diagonal; "auto" takes the blocked matmuls on
    a CPU when the probabilities they keep for backward fit in 32 MiB per layer in fp32,
    128 MiB in bf16 or fp16 (where they were measured faster), SDPA otherwise."""

    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """How attention reaches the other context-parallel ranks' keys and values (with
    context_parallel_size > 1): "p2p" passes them around a ring, overlapping each transfer
    with the previous block's compute; "all_gather" gathers them all at once; "a2a"
    (Ulysses) trades the sequence split for a head split before attention and back after
    (the query groups must divide over the ranks). "a2a+p2p" (hierarchical) runs "a2a"
    within the inner groups of mp-state's hierarchical_context_parallel_sizes, then "p2p"
    across the outer ones (context_parallel/hierarchical.py)."""

    apply_query_key_layer_scaling: bool = False
    """Megatron-LM's guard for fp16 scores: where attention computes its scores as one
    matmul in the input precision (the blocked attention: attention_backend "local" or
    "unfused", an explicit mask, attention dropout), the matmul gives them divided by the
    layer's number (1-based) and the softmax takes them back times it in fp32; the same
    attention. The flash kernels, which never write the scores out in the input
    precision, are unchanged; so are the context-parallel ring's blocks and generation's
    cached attention."""

    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = "vanilla"
    """Attention sinks: "off-by-one" adds a logit 0 to each softmax row (softmax_1), "learnable"
    a learned logit per head (softmax_offset, gpt-oss's sinks; init normal(0,
    init_method_std)); a sink takes probability but contributes no value."""

    window_size: tuple[int, int] | None = None
    """Sliding-window attention (left, right), flash-attn's convention: query i attends to
    keys i - left .. i + right; right must be 0 (causal). "127,0" is gpt-oss's
    sliding_window=128. None: full causal attention."""

    window_attn_skip_freq: int | list[int] | None = None
    """Which layers attend fully despite window_size: an integer N, those numbered n % N == 0
    (1-based; N=2: window, full, window, ... as gpt-oss); or per layer 1 = window, 0 = full
    (1,1,1,0 or [1,1,1,0]*3). None: every layer uses the window."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = (
        "learned_absolute"
    )
    """Position information: a learned table, rotary embeddings (plain, or YaRN's scaling of
    Peng et al. 2023 with the yarn_* fields), or none. Multi-latent attention rotates
    under each (its rope_type choosing plain or YaRN; Megatron's DeepSeek lines give
    "rope"), "learned_absolute" adding the table."""

    rope_type: Literal["rope", "yarn"] | None = None
    """Multi-latent attention's rotary embeddings (Megatron's --rope-type): plain, or YaRN
    with the yarn_* fields; None: yarn, Megatron's MLA default (YaRN with
    yarn_rotary_scaling_factor 1 rotates as plain RoPE). Standard attention takes YaRN as
    position_embedding_type="yarn" and accepts only "rope" here, which changes nothing
    there (position_embedding_type chooses), as in Megatron."""

    rotary_base: int = 10000
    """Base of the rotary frequencies."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    rotary_seq_len_interpolation_factor: float | None = None
    """Positions are divided by this factor (linear interpolation for longer contexts)."""

    use_rope_scaling: bool = False
    """Llama 3.1's rescaling of the rotary frequencies (Megatron's --use-rope-scaling):
    wavelengths above original_max / low_freq_factor are divided by rope_scaling_factor,
    those below original_max / high_freq_factor are kept, and those between are blended
    smoothly (Hugging Face's rope_type "llama3")."""

    rope_scaling_factor: float = 8.0
    """Divisor of the low rotary frequencies under use_rope_scaling (Megatron's
    --rope-scaling-factor)."""

    rope_scaling_low_freq_factor: float = 1.0
    """Under use_rope_scaling, wavelengths above rope_scaling_original_max_position_embeddings
    / this are fully scaled. Megatron has no option for it and uses 1."""

    rope_scaling_high_freq_factor: float = 4.0
    """Under use_rope_scaling, wavelengths below rope_scaling_original_max_position_embeddings
    / this are kept. Megatron has no option for it and uses 4."""

    rope_scaling_original_max_position_embeddings: int = 8192
    """The context length the model was pretrained with before use_rope_scaling. Megatron has
    no option for it and uses 8192."""

    yarn_rotary_scaling_factor: float = field(
        default=1.0, metadata={"argparse_meta": {"names": ["--rotary-scaling-factor"]}}
    )
    """YaRN's context extension factor s: the low frequencies are divided by it."""

    yarn_original_max_position_embeddings: int = 4096
    """YaRN: the context length before extension."""

    yarn_beta_fast: float = 32.0
    """YaRN: frequencies turning over this many times in the original context are kept."""

    yarn_beta_slow: float = 1.0
    """YaRN: those turning fewer times are divided by s; the channels between blend linearly."""

    yarn_mscale: float = field(default=1.0, metadata={"argparse_meta": {"names": ["--mscale"]}})
    """YaRN: cos and sin are multiplied by (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)."""

    yarn_mscale_all_dim: float = field(
        default=0.0, metadata={"argparse_meta": {"names": ["--mscale-all-dim"]}}
    )
    """YaRN: the denominator's mscale (see yarn_mscale). Multi-latent attention also
    multiplies its softmax scale by (0.1 mscale_all_dim ln s + 1)^2, as Megatron and
    DeepSeek do."""

    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the blended channels' ends to integers (gpt-oss does not: truncate false)."""

    qk_layernorm: bool = False
    """Normalize queries and keys per head before attention. With multi_latent_attention:
    normalize the query and key/value latents instead (q_layernorm, kv_layernorm), as
    Megatron does; DeepSeek's models have them."""

    qk_l2_norm: bool = False
    """Llama 4's query and key norm (Megatron's --qk-l2-norm, its L2Norm): each head's query
    and key divided by sqrt(mean(x^2) + layernorm_epsilon), with no weight. Replaces
    qk_layernorm where both are set, as in Megatron (whose Llama 4 Scout line gives both).
    Not with multi_latent_attention."""

    qk_l2_norm_layers: Literal["all", "rope"] = "all"
    """Which layers qk_l2_norm normalizes: all (Megatron's semantics), or only those with
    rotary embeddings (not the no_rope_freq layers), as Llama 4 does (Hugging Face's
    use_qk_norm). mp's own field; Megatron has no such option."""

    rotary_interleaved: bool = False
    """Rotate the neighbouring channels (2i, 2i + 1) together instead of (i, i + rot/2)
    (Megatron's --rotary-interleaved): the layout of Meta's original Llama code and of
    Llama 4, whose checkpoints keep it. Not with multi_latent_attention, as in Megatron."""

    attention_output_gate: bool = False
    """Gated attention (Megatron's --attention-output-gate; Qwen3-Next): the QKV projection
    also gives a gate per query channel, and attention's output is multiplied by
    sigmoid(gate) before the output projection. linear_qkv then holds, group by group,
    the group's query heads, as many gate heads, its key head and its value head
    (Megatron's order); the checkpoint names the gate linear_qkv.gate."""

    no_rope_freq: int | list[int] | None = None
    """Layers without rotary embeddings (NoPE; Llama 4's interleaved NoPE layers, Megatron's
    --no-rope-freq): an integer N, the layers numbered n % N == 0 (1-based; N must divide
    num_layers; 4: three rotary layers, then one without); or per layer 1 = no rotary
    embeddings, 0 = rotary ("([0]*3+[1])*12"). Needs position_embedding_type "rope" or
    "yarn", without multi_latent_attention. None: every layer rotates."""

    attention_chunk_size: int | None = None
    """Llama 4's chunked attention (Hugging Face's attention_chunk_size; Megatron has none):
    the layers with rotary embeddings attend only within aligned blocks of this many
    positions (position p sees positions C floor(p / C) .. p), the no_rope_freq layers
    over the whole sequence. Packed sequences and context parallelism over more than one
    block are not implemented (refused by a run's validation, and at the forward). None:
    every layer sees every earlier position."""

    attn_temperature_floor_scale: int | None = None
    """Llama 4's temperature tuning of the no_rope_freq layers' queries (Hugging Face's
    attn_temperature_tuning with floor_scale; Megatron has none): the query at position p
    is multiplied by 1 + attn_temperature_scale ln(1 + floor((p + 1) / this)), which is 1
    before position this - 1. None: no scaling."""

    attn_temperature_scale: float = 0.1
    """The slope of attn_temperature_floor_scale's query scaling (Hugging Face's
    attn_scale)."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialization of weights."""

    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weight instead of the input embedding's."""

    cross_entropy_loss_fusion: bool = False
    """Compile the cross entropy's two passes over the logits (the forward's sum of
    exponentials, the backward's gradient) with torch.compile: one kernel each per piece
    of 1,024 tokens, reading the logits once in their dtype, instead of eight elementwise
    kernels per 64 tokens through an fp32 work space (mp_layers.tensor_parallel.
    fused_cross_entropy; Megatron's flag, its native implementation). The loss and
    gradients equal the unfused ones within fp32 rounding. The first iteration includes
    the compilation. Applies to the chunked output loss too."""

    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """The fused cross entropy's implementation: native (torch.compile); te (Transformer
    Engine's kernel) is refused."""

    output_loss_chunk_tokens: int = 0
    """Compute the output layer and the cross entropy together, this many tokens at a time
    (mp_layers.tensor_parallel.chunked_linear_cross_entropy), so that the [s, b, v/tp]
    logits and their gradient, the loss's largest activation (2 s b v/tp bytes in bf16:
    2 GiB for 8,192 tokens of a 128k vocabulary), are never held whole: [chunk, v/tp]
    logits replace them. The backward recomputes each chunk's logits: one more
    output-layer GEMM (2 s b h v/tp FLOPs). The same loss and gradients as 0 (to rounding;
    bf16/fp16 weights sum their gradient over the chunks in their own dtype). 0: the
    logits are computed whole."""

    params_dtype: torch.dtype = torch.float32
    """dtype the parameters are created in."""

    bf16: bool = False
    """Train in bf16 mixed precision."""

    fp16: bool = False
    """Train in fp16 mixed precision (with loss scaling)."""

    disable_bf16_reduced_precision_matmul: bool = False
    """With bf16 on a CUDA device, CUDA's bf16 matrix products accumulate without reduced
    precision steps (the run sets torch.backends.cuda.matmul.
    allow_bf16_reduced_precision_reduction=False, as Megatron does). No effect on a CPU."""

    sequence_parallel: bool = False
    """Split norms, dropouts and residuals along the sequence over the TP group (needs TP > 1)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Recompute activations in backward: whole layers, or the modules recompute_modules
    names (core attention unless it names others)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """With full recompute: checkpoint groups of layers (uniform) or the first N layers (block)."""

    recompute_num_layers: int | None = None
    """Layers per recompute group (uniform) or recomputed layers per stage (block); more
    than a stage holds takes them all."""

    recompute_modules: list[str] | None = None
    """What selective recompute recomputes (Megatron's --recompute-modules): "core_attn"
    (core attention), "mlp" (a dense MLP), "moe" (a MoE layer, as moe_layer_recompute),
    "shared_experts" (a MoE layer's shared experts); with their outputs discarded too
    (config_recompute.py): "layernorm" (a layer's input and pre-MLP norms), "moe_act" (the
    experts' activation; needs moe_grouped_gemm), "mla_up_proj" (multi-latent attention's
    up projections and rotary embeddings); "gdn_norm_out" (a gated DeltaNet's output
    norm, which mp's DeltaNet always computes again with its rule in training: accepted,
    no change). None: ["core_attn"], Megatron's default. As in Megatron it changes nothing
    without recompute_granularity='selective'. Megatron's "gdp_in_proj", "gdp_qkv" and
    "mhc" are refused, naming them."""

    mlp_chunks_for_training: int = 1
    """In training, run each dense MLP on this many pieces of the sequence one after another
    (Megatron's --mlp-chunks-for-training): the same result, a smaller peak of the MLP's
    temporaries (its saved activations are the same). Refused in a MoE model."""

    moe_layer_recompute: bool = False
    """Megatron-LM's deprecated switch for selective recompute with "moe" added to
    recompute_modules (core attention, the default module, stays in); refused under a
    full recompute, as in Megatron-LM."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            _positive(name, getattr(self, name))
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _positive("num_query_groups", self.num_query_groups)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size}; set kv_channels for another head width"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        _positive("kv_channels", self.kv_channels)
        if self.ffn_hidden_size is None:
            if self.activation == "swiglu":
                self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        _positive("ffn_hidden_size", self.ffn_hidden_size)
        _choice("normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        _choice("activation", self.activation, ("gelu", "swiglu", "geglu", "squared_relu"))
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice(
            "position_embedding_type", self.position_embedding_type,
            ("learned_absolute", "rope", "yarn", "none"),
        )  # fmt: skip
        if self.openai_gelu and self.activation not in ("gelu", "geglu"):
            gelus = "activation='gelu' or 'geglu'"
            raise ValueError(f"openai_gelu=True applies to {gelus}, got {self.activation!r}")
        self._check_gated_activation()
        check_mla(self)
        infer_hybrid_mtp(self)
        check_mtp(self)
        check_attention_fields(self)
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon={self.layernorm_epsilon} must be > 0")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        _choice("cross_entropy_fusion_impl", self.cross_entropy_fusion_impl, ("native", "te"))
        if self.cross_entropy_fusion_impl == "te":
            raise ValueError(
                "cross_entropy_fusion_impl='te' needs Transformer Engine's fused cross entropy, "
                "which mp does not use: use native (torch.compile)"
            )
        chunk = self.output_loss_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"output_loss_chunk_tokens={chunk!r} must be an integer >= 0")
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std={self.init_method_std} must be > 0")
        check_mup(self)
        _positive("mlp_chunks_for_training", self.mlp_chunks_for_training)
        if self.mlp_chunks_for_training > 1 and self.num_moe_experts is not None:
            raise ValueError(
                f"mlp_chunks_for_training={self.mlp_chunks_for_training} in a MoE model: "
                "routing a piece of the sequence at a time changes the load-balancing "
                "losses; leave it at 1"
            )
        check_qk_clip(self)
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True are exclusive: choose one")
        check_fp8(self)
        apply_moe_layer_recompute(self)
        check_recompute(self)
        check_moe(self)
        check_hybrid(self)
        check_linear_attention(self)
        check_dsa(self)
        check_recompute_modules(self)
        check_norm_placement(self)
        check_window_rope(self)
        check_scales(self)
        check_query_scale(self)

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (a name of recompute_modules)."""
        modules = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        return self.recompute_granularity == "selective" and module in modules

    @property
    def gated_linear_unit(self) -> bool:
        """Whether fc1 gives a gate and a linear part (swiglu, geglu, quick_geglu):
        Megatron's name."""
        return self.activation in ("swiglu", "geglu") or self.quick_geglu

    def _check_gated_activation(self) -> None:
        clamp, offset = self.activation_func_clamp_value, self.glu_linear_offset
        if self.quick_geglu and (self.activation != "gelu" or self.openai_gelu):
            raise ValueError(
                f"quick_geglu=True replaces activation='gelu' (without openai_gelu), got "
                f"activation={self.activation!r}, openai_gelu={self.openai_gelu}"
            )
        if not self.gated_linear_unit:
            for name, value, default in (
                ("glu_linear_offset", offset, 0.0), ("activation_func_clamp_value", clamp, None),
            ):  # fmt: skip
                if value != default:
                    raise ValueError(
                        f"{name}={value} applies to a gated activation (swiglu, geglu or "
                        "quick_geglu), "
                        f"got activation={self.activation!r}"
                    )
            return
        if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
            raise ValueError(f"activation_func_clamp_value={clamp} must be finite and > 0")
        if clamp is not None and self.activation == "swiglu":
            # Megatron's rules for the clamped SwiGLU.
            if self.num_moe_experts is None:
                raise ValueError(
                    f"activation_func_clamp_value={clamp} with activation='swiglu' needs "
                    "num_moe_experts (Megatron clamps SwiGLU in MoE models only)"
                )
            if offset != 0.0:
                raise ValueError(
                    f"glu_linear_offset={offset} with activation='swiglu' and "
                    f"activation_func_clamp_value={clamp} must be 0 (as in Megatron)"
                )

    def moe_layer_pattern(self) -> list[bool]:
        """Per layer of the whole model: whether it is a MoE layer."""
        if self.num_moe_experts is None:
            return [False] * self.num_layers
        if self.hybrid_layer_pattern is not None:
            return [symbol == "E" for symbol in split_hybrid_pattern(self.hybrid_layer_pattern)[0]]
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            freq = [freq]
        if len(freq) == 1 and self.num_layers > 1:
            _positive("moe_layer_freq", freq[0])
            return [i % freq[0] == 0 for i in range(self.num_layers)]
        pattern = list(freq)
        if len(pattern) != self.num_layers or any(x not in (0, 1) for x in pattern):
            raise ValueError(
                f"moe_layer_freq={freq!r} must be an integer or {self.num_layers} values "
                "(num_layers) of 0 or 1"
            )
        return [bool(x) for x in pattern]

    def check_parallel(
        self,
        tensor_model_parallel_size: int,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
    ) -> None:
        """The rules that depend on the parallel sizes; raises ValueError naming them."""
        tp, cp = tensor_model_parallel_size, context_parallel_size
        check_expert_parallel(
            self, tp, cp, expert_model_parallel_size, expert_tensor_parallel_size or tp
        )
        for name in ("num_attention_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(f"tensor_model_parallel_size={tp} does not divide {name}={value}")
        check_query_groups_parallel(self, tp)
        check_norm_placement_parallel(self, tp)
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1, got 1")
        check_attention_parallel(self, tp, cp)
        check_hybrid_parallel(self, tp, cp)
        check_linear_attention_parallel(self, tp, cp)
        check_dsa_parallel(self, cp)

    @property
    def rotary_head_dim(self) -> int:
        """The channels of each head that rotary embeddings see (rotary_percent of them are
        rotated): kv_channels, or multi-latent attention's qk_pos_emb_head_dim."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels
