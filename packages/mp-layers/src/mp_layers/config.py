"""TransformerConfig: the shape and numerics of a GPT model, with Megatron's field names.

Rules that hold whatever the layout are checked in __post_init__; those that
depend on the tensor-parallel size in `check_parallel`. Every message names
the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from mp_layers.config_attention import check_attention_fields, check_attention_parallel
from mp_layers.config_fp8 import check_fp8
from mp_layers.config_hybrid import (
    check_hybrid,
    check_hybrid_parallel,
    infer_hybrid_mtp,
    split_hybrid_pattern,
)
from mp_layers.config_linear_attention import (
    check_linear_attention,
    check_linear_attention_parallel,
)
from mp_layers.config_mla import check_mla
from mp_layers.config_moe import check_expert_parallel, check_moe
from mp_layers.config_mtp import check_mtp
from mp_layers.config_mup import MupConfig, check_mup
from mp_layers.config_qk_clip import QkClipConfig, check_qk_clip
from mp_layers.config_recompute import check_recompute_modules
from mp_layers.config_rules import choice as _choice
from mp_layers.config_rules import positive as _positive

__all__ = ["ATTENTION_BACKENDS", "TransformerConfig"]

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron's --attention-backend choices; mp_layers.transformer.core_attention maps them."""


@dataclass(kw_only=True)
class TransformerConfig(MupConfig, QkClipConfig):
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
    """Key/value heads for grouped-query attention; None: num_attention_heads (MHA)."""

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

    activation: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    """MLP activation; swiglu gates with a second fc1 half (fused)."""

    openai_gelu: bool = False
    """With activation="gelu": the tanh approximation
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of GPT-2 (Hugging Face's gelu_new)
    instead of the exact x Phi(x) (Megatron's --openai-gelu)."""

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
    Peng et al. 2023 with the yarn_* fields), or none. Multi-latent attention takes "rope"
    (Megatron's DeepSeek lines), its rope_type choosing plain or YaRN."""

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

    # --- Multi-latent attention (Megatron's --multi-latent-attention and MLA options) ----

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2; Megatron's MLASelfAttention): queries
    from a latent of q_lora_rank channels, keys and values from a shared latent of
    kv_lora_rank channels (all a KVCache keeps), each head's query and key a
    qk_head_dim part and a rotated qk_pos_emb_head_dim part whose key is shared by all
    heads, values of v_head_dim. Needs position_embedding_type "rope" (rope_type picks
    YaRN, the default, or plain RoPE); no query groups, sinks, windows or QKV bias."""

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

    # --- Linear attention (Megatron's --experimental-attention-variant, --linear-*) -------
    experimental_attention_variant: Literal["gdn", "gated_delta_net"] | None = None
    """The attention of the linear_attention_freq layers (Megatron's
    --experimental-attention-variant; Qwen3-Next): "gdn" (or its alias "gated_delta_net")
    a gated DeltaNet (Yang et al. 2024, transformer/gated_delta_net.py). None: every layer
    has softmax attention. Megatron's "gdn2" and "dsa" are refused, naming them."""

    linear_attention_freq: int | list[int] | None = None
    """Which layers take the linear attention (Megatron's --linear-attention-freq): an
    integer N, N - 1 linear-attention layers then one softmax-attention layer, repeated
    (Qwen3-Next: 4); or one value per layer, 1 linear and 0 softmax attention ("([1]*3+[0])*12"
    on the command line). Needed with experimental_attention_variant."""

    linear_conv_kernel_dim: int = 4
    """The gated DeltaNet's causal convolution width over q, k and v (Megatron's)."""

    linear_key_head_dim: int = 128
    """Channels of each gated DeltaNet query and key head."""

    linear_value_head_dim: int = 128
    """Channels of each gated DeltaNet value (and output gate) head."""

    linear_num_key_heads: int = 16
    """Gated DeltaNet query and key heads; each serves linear_num_value_heads /
    linear_num_key_heads consecutive value heads."""

    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads, each with its own decay and write strength."""

    # --- Multi-token prediction (Megatron's --mtp-num-layers, DeepSeek-V3) -------------
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

    # --- Mamba-hybrid models (Megatron's --hybrid-layer-pattern and --mamba-* options) ----
    hybrid_layer_pattern: str | None = None
    """A hybrid model's layers, one symbol each (Megatron's --hybrid-layer-pattern; Nemotron-H,
    Nemotron-Nano-9B-v2, Nemotron 3): M a Mamba-2 mixer, * self-attention, - a dense MLP,
    E a mixture-of-experts MLP, each layer one of them behind its own norm
    ("M-M-M*-..."); as many symbols as num_layers. Megatron's unified form
    "<main>/<mtp>/<mtp>..." adds multi-token prediction modules, each of the layers after a
    "/" (mtp_num_layers is their number), and "|" in the main part splits the layers into
    pipeline segments, one per virtual pipeline stage. None: every layer is attention then
    an MLP."""

    mamba_num_heads: int | None = None
    """Heads of each Mamba mixer; None: Megatron's default, an inner width of 2 x
    hidden_size divided into heads of mamba_head_dim."""

    mamba_head_dim: int = 64
    """Channels of each Mamba head (Megatron's default 64)."""

    mamba_num_groups: int = 8
    """Groups of Mamba heads sharing their B and C projections (Megatron's default 8); the
    tensor-parallel size must divide it."""

    mamba_state_dim: int = 128
    """The state size n of each Mamba head's channels (Megatron's default 128)."""

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

    # --- FP8 (Megatron's --fp8-* options), through torchao's float8 training -------------

    fp8: Literal["e4m3", "hybrid"] | None = field(
        default=None, metadata={"argparse_meta": {"names": ["--fp8-format"]}}
    )
    """FP8 GEMMs in the transformer layers' linear layers (Megatron's --fp8-format), through
    torchao's float8 training (pip install 'mp-layers[fp8]'): e4m3 for every FP8 tensor, or
    hybrid: e4m3 for activations and weights, e5m2 for the output gradients. Needs bf16 and a
    CUDA GPU with FP8 tensor cores (compute capability 8.9+); the embedding, the output layer,
    norms, attention and routed experts stay in bf16, and parameters, gradients and
    checkpoints keep their dtypes. None: no FP8."""

    fp8_recipe: Literal["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom"] = (
        "tensorwise"
    )
    """How FP8 tensors are scaled, from their current absolute maximum: one scale per tensor,
    or one per row (torchao's rowwise recipe, e4m3 only). Megatron's default, delayed scaling
    from an amax history, is Transformer Engine's and is refused, as are mxfp8, blockwise
    and custom."""

    fp8_wgrad: bool = True
    """Compute the weight gradients' GEMMs in FP8 too; --no-fp8-wgrad keeps them in bf16."""

    fp8_emulate: bool = False
    """Emulate the FP8 casts and GEMMs (torchao's emulate: FP8 rounding, matmuls in high
    precision) on any device, a CPU included: slow, for checking FP8 numerics and layouts on a
    machine without an FP8 GPU."""

    first_last_layers_bf16: bool = False
    """Keep the first num_layers_at_start_in_bf16 and the last num_layers_at_end_in_bf16
    transformer layers of the model in bf16 under --fp8-format."""

    num_layers_at_start_in_bf16: int = 1
    """Layers at the start of the model kept in bf16 with first_last_layers_bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Layers at the end of the model kept in bf16 with first_last_layers_bf16."""

    sequence_parallel: bool = False
    """Split norms, dropouts and residuals along the sequence over the TP group (needs TP > 1)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Recompute activations in backward: whole layers, or the modules recompute_modules
    names (core attention unless it names others)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """With full recompute: checkpoint groups of layers (uniform) or the first N layers (block)."""

    recompute_num_layers: int | None = None
    """Layers per recompute group (uniform) or recomputed layers per stage (block)."""

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

    # --- Mixture of experts (Megatron's --num-experts and --moe-* options) ---------------

    num_moe_experts: int | None = field(
        default=None, metadata={"argparse_meta": {"names": ["--num-experts"]}}
    )
    """Routed experts of each MoE layer (Megatron's --num-experts); None: a dense model."""

    moe_ffn_hidden_size: int | None = None
    """Inner width of each routed expert; None: ffn_hidden_size."""

    moe_router_topk: int = 2
    """Experts each token is sent to."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """How the router turns its logits into scores."""

    moe_router_pre_softmax: bool = False
    """With softmax scores: the softmax over all experts, then the top k (their weights do
    not sum to 1); False: the top k logits, then a softmax over those k. No effect with
    sigmoid scores (as in Megatron, which accepts it there)."""

    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2/V3's device- or node-limited routing): the
    experts are split into this many equal groups (consecutive expert indices); None: no
    groups. Needs moe_router_group_topk."""

    moe_router_group_topk: int | None = None
    """Group-limited routing: the groups each token may use, those with the highest sum of
    their top (topk / group_topk) scores (with the expert bias, if any); the top k experts
    are then chosen within them. Needs moe_router_num_groups."""

    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the routing weights of the chosen experts."""

    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    ] = field(default="aux_loss", metadata={"argparse_meta": {"nargs": "+"}})
    """The auxiliary load-balancing loss: over the micro-batch's tokens (Switch
    Transformer), per sequence (DeepSeek-V2/V3), over the global batch (token counts
    summed over the tp x dp x cp ranks and averaged over the step's micro-batches so far),
    or none. One type: Megatron's list of several (with a list of coefficients) is
    refused."""

    moe_aux_loss_coeff: float = field(default=0.0, metadata={"argparse_meta": {"nargs": "+"}})
    """Weight of the load-balancing loss (0: not computed); one value (Megatron's list of
    one per balancing type is refused with more than one)."""

    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); None: none."""

    moe_router_enable_expert_bias: bool = False
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores
    when choosing experts (not to the weights), moved after each step towards the
    experts that received fewer tokens than the mean."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert bias update: bias += rate * sign(mean load - load)."""

    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most ceil(tokens * topk / experts * factor) tokens of a
    micro-batch (per rank); the others are dropped (their weight is 0). None: no limit."""

    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: every expert computes exactly its capacity, padded."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Which tokens an expert over capacity keeps: the highest routing weights, or the
    earliest positions."""

    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert every token passes through; None: none."""

    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w) with a learned w [1, h]
    (Qwen2-MoE's shared_expert_gate)."""

    moe_layer_freq: list[int] = field(default_factory=lambda: [1])
    """Which layers are MoE: one value N, every N-th (layer i when i % N == 0); or one 0/1
    per layer (num_layers values), also as Megatron's "([0]+[1]*26)". An int N is [N]."""

    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = "allgather"
    """How tokens reach experts on other expert-parallel ranks: an all-to-all of each
    expert's tokens, or an all-gather of every token. Megatron's "flex" (DeepEP or
    HybridEP kernels) is refused."""

    moe_grouped_gemm: bool = False
    """Compute the local experts with torch's grouped matmul (torch._grouped_mm) instead of
    one matmul per expert."""

    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Precision of the router's logits and scores; None: the activations' dtype."""

    moe_router_force_load_balancing: bool = False
    """For benchmarks only (Megatron's --moe-router-force-load-balancing): the router's
    logits are replaced by standard normal draws (the expert-parallel RNG stream, a
    different one per expert shard), so tokens spread evenly over the experts whatever the
    weights; the gradient passes through to the logits unchanged."""

    moe_router_force_biased: float | None = None
    """For benchmarks only (Megatron's --moe-router-force-biased S): as
    moe_router_force_load_balancing, then a per-expert bias drawn from N(0, |S|) added to the
    random logits, the same on every rank (the data-parallel RNG stream), so some experts
    get more tokens: an imbalance to measure. S > 0 draws a new bias at each forward; S < 0
    draws one per layer and keeps it."""

    moe_input_jitter_eps: float | None = None
    """Multiply the router's input by uniform noise in [1 - eps, 1 + eps] in training
    (Switch Transformer's jitter; Megatron's --moe-input-jitter-eps), only the router's:
    the experts see the tokens unchanged."""

    moe_apply_probs_on_input: bool = False
    """Multiply each expert's input, not its output, by the token's routing weight (Llama 4;
    Megatron's --moe-apply-probs-on-input): y = expert(p x) instead of p expert(x). Needs
    moe_router_topk 1, as in Megatron."""

    moe_latent_size: int | None = None
    """Latent MoE (Nemotron 3 Super and Ultra; Megatron's --moe-latent-size): the routed
    experts run in a space of this width. The router sees the hidden state; fc1_latent_proj
    projects it down before the dispatch and fc2_latent_proj projects the combined output
    back up (both whole on every tensor-parallel rank); a shared expert runs on the hidden
    state. None: the experts run at hidden_size."""

    mlp_chunks_for_training: int = 1
    """In training, run each dense MLP on this many pieces of the sequence one after another
    (Megatron's --mlp-chunks-for-training): the same result, a smaller peak of the MLP's
    temporaries (its saved activations are the same). Refused in a MoE model."""

    moe_layer_recompute: bool = False
    """Recompute each MoE layer in backward from its input (under a full recompute: no-op)."""

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
        _choice("activation", self.activation, ("gelu", "swiglu", "squared_relu"))
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice(
            "position_embedding_type", self.position_embedding_type,
            ("learned_absolute", "rope", "yarn", "none"),
        )  # fmt: skip
        if self.openai_gelu and self.activation != "gelu":
            raise ValueError(
                f"openai_gelu=True applies to activation='gelu', got {self.activation!r}"
            )
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
        self._check_recompute()
        check_moe(self)
        check_hybrid(self)
        check_linear_attention(self)
        check_recompute_modules(self)

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (a name of recompute_modules)."""
        modules = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        return self.recompute_granularity == "selective" and module in modules

    def _check_recompute(self) -> None:
        granularity, method, n = (
            self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        )  # fmt: skip
        if granularity is not None:
            _choice("recompute_granularity", granularity, ("full", "selective"))
        if method is not None:
            _choice("recompute_method", method, ("uniform", "block"))
        if granularity == "full":
            if method is None or n is None:
                raise ValueError(
                    "recompute_granularity='full' needs recompute_method ('uniform' or 'block') "
                    f"and recompute_num_layers, got {method!r} and {n!r}"
                )
            if not 1 <= n <= self.num_layers:
                raise ValueError(
                    f"recompute_num_layers={n} must be in 1..num_layers={self.num_layers}"
                )
        elif method is not None or n is not None:
            raise ValueError(
                f"recompute_method={method!r} and recompute_num_layers={n!r} apply only to "
                f"recompute_granularity='full', got {granularity!r}"
            )

    @property
    def gated_linear_unit(self) -> bool:
        """Whether fc1 gives a gate and a linear part (swiglu, quick_geglu): Megatron's name."""
        return self.activation == "swiglu" or self.quick_geglu

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
                        f"{name}={value} applies to a gated activation (swiglu or quick_geglu), "
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
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(f"tensor_model_parallel_size={tp} does not divide {name}={value}")
        if self.sequence_parallel and tp == 1:
            raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1, got 1")
        check_attention_parallel(self, tp, cp)
        check_hybrid_parallel(self, tp, cp)
        check_linear_attention_parallel(self, tp, cp)

    @property
    def rotary_head_dim(self) -> int:
        """The channels of each head that rotary embeddings see (rotary_percent of them are
        rotated): kv_channels, or multi-latent attention's qk_pos_emb_head_dim."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels
