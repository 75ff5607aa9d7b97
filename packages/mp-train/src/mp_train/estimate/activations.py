"""Activations of one pipeline stage's most loaded rank, for mp_train.estimate.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2, with f generalised as Megatron does): one layer and
micro-batch stores 10sbh that tensor parallelism leaves whole (norm inputs, QKV and fc1
inputs, dropout masks), sbh(8 + 4f/h) it splits, and the attention scores 5as^2b unless
core attention is recomputed (selective, with core_attn among recompute_modules, the
default):

    sequence parallel + selective   sbh(18 + 4f/h) / t         Megatron's compute_activation_memory
    sequence parallel               (sbh(18 + 4f/h) + 5as^2b) / t
    selective                       sbh(10 + (8 + 4f/h) / t)   (f = 4h: Megatron's sbh(10 + 24/t))
    no recompute                    sbh(10 + (8 + 4f/h) / t) + 5as^2b / t
    full recompute                  2sbh (/ t with sequence parallel) per checkpointed input,
                                    plus one recomputed group's activations during backward

Selective recompute's other modules leave out what they rebuild in backward (Megatron's
--recompute-modules): "layernorm" each norm's output 2sbh (whole), "mla_up_proj" the
queries, keys and values 6sbh of attention's 8sbh, "mlp" and "moe" a recomputed MLP's
split part, "moe_act" the routed experts' activation output 2kf_moe/h sbh,
"shared_experts" the shared expert's 4f_shared/h sbh.

The first stage keeps its layers with p micro-batches in flight (L layers' worth with
an even split), plus the embedding's 8sb + sbh per in-flight micro-batch; all of it x (1
+ (p - 1) / (p v)) under the interleaved schedule, or x min(1, m / p) under 1F1B. The last
stage (p > 1) keeps its layers for one micro-batch (interleaved: (v - 1) p + 1 of its
chunks' micro-batches). The last stage also keeps the output layer's 4sbh + 4sbV (4cV for
the logits of a chunk of c < sb tokens with output_loss_chunk_tokens c), and per MTP
module its layer, its norms' and eh_proj's inputs 8sbh (under a full recompute only its
two inputs, 4sbh) and its own output layer's term. Under sequence parallelism every term
is divided by t, otherwise only the split ones. Context parallelism stores s / c tokens
per rank; the scores are a (s / c) s b. MoE layers replace f by k f_moe + f_shared
(averaged over the stage's layers); the router's logits and the dispatcher's buffers are
not counted, nor a latent MoE's narrower expert inputs and its projections' (counted as a
MoE layer's). A hybrid model's layer (hybrid_layer_pattern) keeps its one sublayer's share:
attention 5sbh whole and 8sbh + scores split, an MLP 5sbh whole and 4f/h sbh split, a Mamba
layer what mp_train.estimate.hybrid counts (partly fp32 whatever the precision); the
stage's layers are averaged.
The score term counts what mp's core attention keeps: blocked attention ("local",
"unfused", or "auto" on a CPU within its memory limit) keeps the causal blocks of its
probabilities, 5 bytes a score with dropout and 2 without; SDPA (flash attention) and the
context-parallel ring and all-gather blocks keep none; all-to-all context parallelism
attends over the whole sequence with a / c heads. The coefficients count 16-bit
activations; an fp32 model doubles them. Multi-latent attention's activations are
estimated with the same formula, as Megatron does (h for the widths the layer keeps).
"""

from __future__ import annotations

import math

import torch

from mp_layers import (
    TransformerConfig,
    keeps_attention_probabilities,
    mtp_layer_kinds,
    saved_probability_bytes,
)
from mp_train.configuration.config import RunConfig
from mp_train.estimate.hybrid import mamba_activation
from mp_train.estimate.linear_attention import gdn_activation
from mp_train.estimate.parameters import stage_chunk_layers, stage_layer_kinds

__all__ = ["activation_bytes", "mlp_width"]


def mlp_width(m: TransformerConfig, moe: bool) -> int:
    """The f of the activation formula: k f_moe + f_shared for a MoE layer."""
    if not moe:
        return m.ffn_hidden_size
    return m.moe_router_topk * m.moe_ffn_hidden_size + (m.moe_shared_expert_intermediate_size or 0)


def activation_bytes(
    config: RunConfig, layout: dict, V: int, device_type: str, stage: int
) -> tuple[float, str]:
    """Activation bytes of pipeline stage `stage` (see the module docstring)."""
    m = config.model
    tp, pp, vpp = layout["tp"], layout["pp"], layout["vpp"]
    s = config.gpt.seq_length / layout["cp"]  # tokens of a sequence on one rank
    b, h = config.training.micro_batch_size, m.hidden_size
    kinds = stage_layer_kinds(config, stage)
    sp, granularity = m.sequence_parallel, m.recompute_granularity
    sbh = s * b * h
    # The coefficients count 16-bit activations (bf16/fp16 runs, as Megatron's); an fp32
    # model keeps every activation at twice the size.
    width = 1 if m.bf16 or m.fp16 else 2

    def stored(whole: float, split: float) -> float:
        return (whole + split) / tp if sp else whole + split / tp

    scores = _score_bytes(config, layout, b, device_type)

    def layer_bytes(kind: str, moe: bool) -> float:
        """Attention 5sbh whole, 8sbh + scores split; an MLP 5sbh whole, 4f/h sbh split
        (Korthikanti et al.'s 10sbh and (8 + 4f/h)sbh by sublayer); a Mamba layer
        mp_train.estimate.hybrid's (its fp32 part / width: the total is x width below);
        less what selective recompute's modules leave out (_recomputed_share); with
        sublayer_norm "both" each output norm's input 2sbh more (whole)."""
        if kind == "mamba":
            whole, split, fp32 = mamba_activation(m, s, b)
            return stored(whole, split) + fp32 / tp / width
        whole = split = extra = 0.0
        if kind in ("transformer", "attention"):
            whole, split = 5 * sbh, 8 * sbh + scores
        if kind in ("linear", "gdn"):  # mp_train.estimate.linear_attention's
            whole, split, fp32 = gdn_activation(m, s, b)
            extra = fp32 / tp / width
        if kind in ("transformer", "linear", "mlp", "moe"):
            whole, split = whole + 5 * sbh, split + 4 * mlp_width(m, moe) / h * sbh
        if m.sublayer_norm == "both":  # the output norms' inputs: one per sublayer
            whole += 2 * sbh * (2 if kind in ("transformer", "linear") else 1)
        less_whole, less_split = _recomputed_share(m, kind, moe, sbh)
        return stored(whole - less_whole, split - less_split) + extra

    # the mean (a stage of a pipeline layout may hold none: embedding or loss alone)
    layer = sum(layer_bytes(kind, moe) for kind, moe in kinds) / len(kinds) if kinds else 0.0
    transient = 0.0
    if granularity == "full" and kinds:
        # each model chunk's layers (uneven where segments place them; none in a chunk of
        # the embedding or the loss alone), recomputed chunk by chunk
        chunks = [count for count in stage_chunk_layers(config, stage) if count]
        groups = [min(m.recompute_num_layers, count) for count in chunks]
        checkpoint = stored(2 * sbh, 0)  # each recomputed group keeps only its input
        if m.recompute_method == "uniform":  # groups of n layers, each keeping its input
            kept = sum(math.ceil(count / n) for count, n in zip(chunks, groups, strict=True))
            per_layer = checkpoint * kept / len(kinds)
            n = max(groups)
        else:  # block: the first n layers of each chunk, one layer at a time
            per_layer = (sum(groups) * checkpoint + (len(kinds) - sum(groups)) * layer) / len(kinds)
            n = 1
        transient = n * layer  # the group being recomputed, one micro-batch
        layer = per_layer
    if stage == 0:
        # up to pp micro-batches in flight (L layers' worth with an even split)
        total = layer * len(kinds) * pp
        total += stored(8 * s * b + sbh, 0) * pp  # token ids, embedding dropout mask
        if vpp is not None:
            total *= 1 + (pp - 1) / (pp * vpp)
        elif pp > 1:
            total *= min(1.0, layout["microbatches"] / pp)
    else:  # the last stage: one micro-batch, or (v - 1) p + 1 chunks' under interleaving
        chunks_in_flight = 1 if vpp is None else (vpp - 1) * pp + 1
        total = layer * len(kinds) / (vpp or 1) * chunks_in_flight
    if stage == pp - 1:
        # The output layer's input and logits: one chunk's with output_loss_chunk_tokens.
        tokens = min(s * b, m.output_loss_chunk_tokens or s * b)
        output = stored(4 * sbh, 4 * tokens * V)
        total += output
        # Each MTP module: its layers, its norms' inputs (2sbh each) and eh_proj's (4sbh),
        # and its own logits; under a full recompute the module keeps only its two inputs
        # (the hidden state and the embedding, recomputed from them in backward).
        mtp_layers = sum(layer_bytes(kind, moe) for kind, moe in mtp_layer_kinds(m))
        module = stored(4 * sbh, 0) if granularity == "full" else mtp_layers + stored(8 * sbh, 0)
        total += (m.mtp_num_layers or 0) * (module + output)
    selective = "selective recompute"
    if m.recompute_modules is not None:  # (None: core_attn, Megatron's default)
        selective += f" ({' '.join(m.recompute_modules)})"
    recompute = {None: "no recompute", "selective": selective}.get(
        granularity, f"full recompute ({m.recompute_method})"
    )
    formula = ("sequence parallel, " if sp else "") + recompute
    return (total + transient) * width, formula


def _recomputed_share(m, kind: str, moe: bool, sbh: float) -> tuple[float, float]:
    """(whole, split) of layer_bytes' terms that selective recompute's modules
    (recompute_modules) do not keep: "layernorm" each norm's output (2sbh, the next
    projection's input), "mla_up_proj" multi-latent attention's queries, keys and values
    (6sbh of its 8sbh split), "mlp" / "moe" a recomputed MLP's split part (it keeps its
    input, the norm's output), "moe_act" the routed experts' activation output (2 k
    f_moe / h sbh, fc2's input), "shared_experts" the shared expert's 4 f_shared / h sbh
    (m.recomputes names none of them without selective recompute; moe_layer_recompute
    counts unless the recompute is full, which _activation_bytes counts itself)."""
    if m.recompute_granularity == "full":
        return 0.0, 0.0
    whole = split = 0.0
    sublayers = {"transformer": 2, "linear": 2, "attention": 1, "gdn": 1, "mlp": 1, "moe": 1}
    if m.recomputes("layernorm"):
        whole += 2 * sbh * sublayers[kind]
    if kind in ("transformer", "attention") and m.recomputes("mla_up_proj"):
        split += 6 * sbh
    if kind in ("transformer", "linear", "mlp", "moe"):
        h = m.hidden_size
        whole_mlp = m.recomputes("moe") or m.moe_layer_recompute if moe else m.recomputes("mlp")
        if whole_mlp:  # the MLP keeps its input only
            split += 4 * mlp_width(m, moe) / h * sbh
        elif moe:
            if m.recomputes("moe_act"):
                split += 2 * m.moe_router_topk * m.moe_ffn_hidden_size / h * sbh
            if m.recomputes("shared_experts"):
                split += 4 * (m.moe_shared_expert_intermediate_size or 0) / h * sbh
    return whole, split


def _score_bytes(config: RunConfig, layout: dict, b: int, device_type: str) -> float:
    """The attention probabilities one layer keeps for backward on the most loaded rank,
    before the tensor-parallel split: 5 bytes per kept score with dropout (softmax output,
    dropout output, mask: Megatron's 5as^2b), 2 without; none where the core attention
    keeps none (see the module docstring)."""
    m = config.model
    if m.recomputes("core_attn"):
        return 0.0
    cp, tp = layout["cp"], layout["tp"]
    if cp > 1 and m.cp_comm_type != "a2a":
        return 0.0  # ring and all-gather blocks keep their outputs and log-sum-exps only
    s = config.gpt.seq_length  # a2a attends over the whole sequence with a / cp heads
    heads = m.num_attention_heads // cp
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    # Packed documents (reset_attention_mask) attend one by one: at most the causal
    # sequence's probabilities, when one document fills it.
    if not keeps_attention_probabilities(m.attention_backend, device_type, s, b, heads // tp,
                                         dtype):  # fmt: skip
        return 0.0
    kept = saved_probability_bytes(s, b, heads, 1, causal=True)
    return (5 if m.attention_dropout > 0 else 2) * kept
