"""Theoretical memory of the most loaded rank and FLOPs per iteration, from the configuration alone.

    mp-train estimate [--config FILE.yaml] [overrides...] --world-size N [--vocab-size V]
        [--device cuda|cpu] [--megatron-formula]

prints one JSON object and starts no process. Every option of the run applies; a
mixture-of-experts model is described by the model's own fields (num_moe_experts,
moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size,
moe_shared_expert_gate, moe_layer_freq) and the layout by expert_model_parallel_size and
expert_tensor_parallel_size. Symbols: s sequence, b micro-batch, h hidden, a heads, g
query groups, d head width (kv_channels), f ffn width, L layers, V padded vocabulary,
t/p/v/c/e tensor/pipeline/virtual-pipeline/context/expert parallel sizes, m micro-batches
per iteration, B global batch; for MoE layers E routed experts, k of them per token,
f_moe their width, f_shared the shared expert's; n_mtp multi-token prediction modules
(mtp_num_layers). MB is 2^20 bytes.

This module is mp's own model: what the run allocates and keeps, measured against
GPTModel and the run's memory (docs/benchmarks.md). With --megatron-formula the figures
are instead Megatron-LM's report_theoretical_memory and num_floating_point_operations
(megatron-core 0.19.2), to the bit: mp_train.estimate.megatron_formula, which says what those
formulas assume.

Parameters (mp_train.estimate.parameters): every parameter GPTModel holds (biases, norms,
routers, learned positions and the MTP modules included), and each pipeline stage's
share as one of its ranks holds it: tensor-parallel pieces / t, replicated parameters
(norms, row-parallel biases, routers, MLA's down projections) whole, routed experts /
(e x expert-t). num_active_parameters counts the k routed experts a token passes through
instead of all E.

Bytes per parameter: weight + gradient + optimizer state (fp32 main copy under mixed
precision, Adam's two moments or SGD's momentum). bf16/fp16 with fp32 gradients and Adam
is Megatron's 2 + 4 + 12 = 18, and 6 + 12 / dp with the distributed optimizer, which
shards only the optimizer state (the precision-aware optimizer's bf16 moments: 2 bytes
each, 6 + 8 / dp), over dp x c ranks (experts: their data-parallel ranks).

The most loaded rank: of the first and the last pipeline stage, the one whose weights,
optimizer state and activations add up to more (pipeline_stage says which; one stage
with p = 1).

Activations: mp_train.estimate.activations (Korthikanti et al.'s formulas, with what mp's
core attention, recompute, pipeline schedule, MoE and MTP keep).

FLOPs (Megatron-LM's num_floating_point_operations): forward + backward is 3 GEMMs per
weight and a GEMM of (m x n)(n x k) is 2mnk, so per token and layer
6[h(ad + 2gd) + ad s + ad h] for attention (the causal mask halves QK^T and its product
with V), 6hf x (3|2) for a dense MLP, 6h(k f_moe + f_shared) x (3|2) for a MoE one, and
6hV for the logits (a latent MoE layer, moe_latent_size L: 6(k f_moe L + f_shared h) x
(3|2) + 12hL, its experts at width L and its two projections, Megatron's terms); per MTP
module one more layer of the last layer's kind, 6(3h + 2h^2)
for its norms and eh_proj and 6hV for its logits; times B s (the router's 6hE per token
and MoE layer is left out, as Megatron does). They are the model's FLOPs: recomputation
(activation recompute, the chunked output loss's second logits GEMM) is not counted, as
in Megatron's MFU. With a = g, f = 4h it is 72BsLh^2(1 + s/(12h) + V/(12Lh)).
Multi-latent attention's per token and layer, Megatron's MLA branch: 6[r_q(h + a(dn +
dr) + 1) + r(h + a(dn + dv) + 1) + h dr + a dv h + s a(dn + dr + dv)/2] (r kv_lora_rank,
r_q q_lora_rank, dn qk_head_dim, dr qk_pos_emb_head_dim, dv v_head_dim; r_q(...) is
ha(dn + dr) without a query latent; the + 1 counts each latent norm). A hybrid model's
layers, Megatron's hybrid_flops: attention (*) and MLP (-, E) layers their sublayer's terms
above, a Mamba layer (M) 3[2h(2I + 2GN + H) + 7IN + 2Ih] (Megatron's mamba_layer_flops with
the layer's inner width I; mp_train.estimate.hybrid derives it and compares the scan with
the chunked form's).
"""

from __future__ import annotations

import argparse
import json
import sys

from mp_layers import (
    TransformerConfig,
    mtp_layer_kinds,
)
from mp_pipeline import stage_layers
from mp_train.configuration.batch_sizes import parse_batch_schedule, running_global_batch
from mp_train.configuration.config import RunConfig, check_model_parallel
from mp_train.configuration.pipeline_segments import pipeline_segments
from mp_train.estimate.activations import activation_bytes, mlp_width
from mp_train.estimate.hybrid import mamba_flops
from mp_train.estimate.linear_attention import gdn_flops, layer_kinds
from mp_train.estimate.megatron_formula import MEGATRON_VERSION, megatron_estimate
from mp_train.estimate.parameters import model_parameters, stage_embeddings, stage_parameters

__all__ = ["estimate", "main", "padded_vocab_size"]

_MB = 2**20


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padding: up to a multiple of make_vocab_size_divisible_by x tp."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def estimate(
    config: RunConfig,
    world_size: int,
    *,
    vocab_size: int | None = None,
    device_type: str = "cuda",
    megatron_formula: bool = False,
) -> dict:
    """num_parameters, weight_and_optimizer_mb, activation_mb, total_mb (most loaded rank)
    and flops_per_iteration (one global batch, forward + backward), with the figures they
    are made of. A MoE model (config.model.num_moe_experts) is read from the model's fields
    and config.parallel's expert sizes. `vocab_size` overrides config.data.vocab_size;
    `device_type` ("cuda" or "cpu") is where the run computes, which decides the core
    attention "auto" picks. `megatron_formula`: Megatron-LM's figures instead of mp's
    (mp_train.estimate.megatron_formula), with its report's lines under "megatron_report"."""
    layout = _layout(config, world_size)
    vocab = vocab_size if vocab_size is not None else config.data.vocab_size
    V = config.data.padded_vocab_size
    if V is None:
        if vocab is None:
            raise ValueError("no vocabulary size: set vocab_size (--vocab-size) or "
                             "padded_vocab_size; the tokenizer is not read")  # fmt: skip
        _positive("vocab_size", vocab)
        V = padded_vocab_size(vocab, config.data.make_vocab_size_divisible_by, layout["tp"])
    if megatron_formula:
        return megatron_estimate(config, layout, V)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r} must be cuda or cpu")
    params = model_parameters(config, V)
    stages = []
    for stage in sorted({0, layout["pp"] - 1}):
        weights = _weight_and_optimizer(config, layout, V, stage)
        activations, formula = activation_bytes(config, layout, V, device_type, stage)
        stages.append((weights["bytes"] + activations, stage, weights, activations))
    _, stage, weights, activations = max(stages, key=lambda figures: figures[0])
    weight_mb = weights["bytes"] / _MB
    activation_mb = activations / _MB
    return {
        "num_parameters": params["total"],
        "num_active_parameters": params["active"],
        "weight_and_optimizer_mb": weight_mb,
        "activation_mb": activation_mb,
        "total_mb": weight_mb + activation_mb,
        "flops_per_iteration": _flops(config, layout, V),
        "padded_vocab_size": V,
        "pipeline_stage": stage,
        "parameters_on_most_loaded_shard": weights["shard"],
        "expert_parameters_on_most_loaded_shard": weights["expert_shard"],
        "bytes_per_parameter": weights["bytes_per_parameter"],
        "activation_formula": formula,
        "data_parallel_size": layout["dp"],
        "global_batch_size": layout["gbs"],
        "num_microbatches": layout["microbatches"],
    }


def _layout(config: RunConfig, world_size: int) -> dict:
    """Sizes derived from the world (what `validate` derives, without needing data)."""
    parallel, model, training = config.parallel, config.model, config.training
    tp, pp, cp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
    )
    vpp = parallel.virtual_pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    dp = parallel.data_parallel_size(world_size)
    check_model_parallel(config)
    first = parallel.decoder_first_pipeline_num_layers
    last = parallel.decoder_last_pipeline_num_layers
    segments = pipeline_segments(config)
    uneven = first is not None or last is not None or segments is not None
    if not uneven and model.num_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size="
            f"{pp} x virtual_pipeline_model_parallel_size={vpp or 1}"
        )
    # every stage's share (refused, naming the stage, when it does not split)
    for rank in range(pp):
        stage_layers(model.num_layers, pp, rank, virtual_pipeline_model_parallel_size=vpp,
                     num_layers_in_first_pipeline_stage=first,
                     num_layers_in_last_pipeline_stage=last, segments=segments)  # fmt: skip
    seq = config.gpt.seq_length
    if seq % cp:
        raise ValueError(f"context_parallel_size={cp} does not divide seq_length={seq}")
    mbs = training.micro_batch_size
    gbs = training.global_batch_size if training.global_batch_size is not None else mbs * dp
    if training.step_batch_size_schedule is not None:  # the run's first global batch
        gbs = parse_batch_schedule(training.step_batch_size_schedule, seq)[0][1]
    if mbs < 1:
        raise ValueError(f"micro_batch_size={mbs} must be >= 1")
    try:  # the batch trained with (smaller under decrease_batch_size_if_needed)
        gbs = running_global_batch(training, gbs, dp)
    except ValueError as error:
        raise ValueError(f"{error} (world size {world_size})") from None
    if config.optimizer.bf16 != model.bf16 or config.optimizer.fp16 != model.fp16:
        raise ValueError(
            f"the model (bf16={model.bf16}, fp16={model.fp16}) and the optimizer "
            f"(bf16={config.optimizer.bf16}, fp16={config.optimizer.fp16}) disagree on the "
            "precision"
        )
    # Expert layers re-divide each stage's t x c x dp ranks as expert-t x e x expert-dp.
    edp = parallel.expert_data_parallel_size(world_size) if model.num_moe_experts else dp * cp
    return {
        "world_size": world_size, "tp": tp, "pp": pp, "cp": cp, "vpp": vpp, "dp": dp,
        "ep": ep, "etp": etp, "edp": edp, "gbs": gbs, "microbatches": gbs // (mbs * dp),
    }  # fmt: skip


def _weight_and_optimizer(config: RunConfig, layout: dict, V: int, stage: int) -> dict:
    """The weights and optimizer state of one rank of pipeline stage `stage`."""
    held = stage_parameters(config, V, stage)
    shard, expert_shard = held.on_rank(layout["tp"], layout["ep"], layout["etp"])
    weight, grad, state = _bytes_per_parameter(config)
    optimizer = config.optimizer
    dense_div = expert_div = 1
    sharded = optimizer.use_distributed_optimizer or optimizer.use_layer_wise_distributed_optimizer
    if sharded or optimizer.fully_sharded:
        # Megatron shards over the data-parallel group that includes the context ranks, or
        # over a slice of it with several distributed-optimizer instances.
        instances = config.parallel.num_distributed_optimizer_instances
        dense_div = layout["dp"] * layout["cp"] // instances
        expert_div = layout["edp"] // instances
    if optimizer.fully_sharded:
        # ZeRO-2/3 (mp's FSDP): each rank holds its fp32 rows of every parameter, which are
        # the optimizer's main parameters, their fp32 gradients and the optimizer state,
        # all divided (a layer is whole only while it computes: activations' share).
        rows = 4 + 4 + state - (4 if optimizer.bf16 or optimizer.fp16 else 0)
        dense_bytes, expert_bytes = rows / dense_div, rows / expert_div
    else:
        dense_bytes = weight + grad + state / dense_div
        expert_bytes = weight + grad + state / expert_div
    total = shard * dense_bytes + expert_shard * expert_bytes
    if optimizer.optimizer == "muon":
        # Muon's momentum on the matrices, Adam's two moments on the embedding and output
        # weights (norms and biases are counted as matrices: a small share)
        adam = stage_embeddings(config, V, stage) / layout["tp"]
        total += adam * 4 / dense_div
    return {
        "shard": shard,
        "expert_shard": expert_shard,
        "bytes_per_parameter": dense_bytes,
        "bytes": total,
    }


def _bytes_per_parameter(config: RunConfig) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes of one parameter."""
    optimizer = config.optimizer
    mixed = optimizer.bf16 or optimizer.fp16
    weight = 2 if mixed else 4
    grad = 4 if optimizer.grad_reduce_in_fp32 or not mixed else 2
    sgd_moments = 4 if optimizer.sgd_momentum > 0 else 0
    # Adam's two moments in their storage dtypes (the precision-aware optimizer's bf16: 2)
    adam = sum(t.itemsize for t in optimizer.moment_dtypes.values())
    muon = 4  # its momentum (the embedding's Adam moments: _weight_and_optimizer)
    lion = 4  # its momentum
    moments = {"adam": adam, "sgd": sgd_moments, "muon": muon, "lion": lion}[optimizer.optimizer]
    return weight, grad, (4 if mixed else 0) + moments


def _flops(config: RunConfig, layout: dict, V: int) -> int:
    m = config.model
    s, h = config.gpt.seq_length, m.hidden_size
    gated = 3 if m.gated_linear_unit else 2
    mtp = m.mtp_num_layers or 0
    layers = list(zip(layer_kinds(m), m.moe_layer_pattern(), strict=True))
    last = layer_kinds(m)[-1]  # a module's transformer layer is shaped as the last
    layers += [(last if kind == "transformer" else kind, moe)
               for kind, moe in mtp_layer_kinds(m)] * mtp  # or a hybrid pattern's  # fmt: skip
    kinds = [kind for kind, _ in layers]
    with_mlp = [moe for kind, moe in layers if kind in ("transformer", "linear", "mlp", "moe")]
    mlp = sum(_mlp_multiply_adds(m, moe, gated) for moe in with_mlp)
    attention = _attention_flops(m, s) * sum(kind in ("transformer", "attention") for kind in kinds)
    mtp_projections = mtp * (3 * h + 2 * h * h)  # its norms (Megatron's 3h) and eh_proj
    # fwd + 2 bwd GEMMs, 2 per multiply-add
    per_token = 3 * 2 * (mlp + attention + mtp_projections + h * V * (1 + mtp))
    per_token += kinds.count("mamba") * mamba_flops(m)  # mp_train.estimate.hybrid
    per_token += (kinds.count("gdn") + kinds.count("linear")) * gdn_flops(m)  # linear_attention
    return layout["gbs"] * s * per_token


def _mlp_multiply_adds(m: TransformerConfig, moe: bool, gated: int) -> int:
    """One MLP's multiply-adds per token: h f (3|2), h (k f_moe + f_shared) (3|2) for a MoE
    one; a latent MoE's routed experts at its width L, k f_moe L (3|2), and its two
    projections 2hL (Megatron's moe_latent_size terms)."""
    h, latent = m.hidden_size, m.moe_latent_size
    if not moe or latent is None:
        return h * mlp_width(m, moe) * gated
    shared = m.moe_shared_expert_intermediate_size or 0
    routed = m.moe_router_topk * m.moe_ffn_hidden_size * latent
    return (routed + shared * h) * gated + 2 * h * latent


def _attention_flops(m: TransformerConfig, s: int) -> float:
    """One layer's attention multiply-adds per token, Megatron's num_floating_point_operations:
    the projections, and QK^T and (QK^T)V at half (the causal mask)."""
    a = m.num_attention_heads
    if not m.multi_latent_attention:
        q = m.kv_channels * a
        kv = m.kv_channels * m.num_query_groups
        gate = q if m.attention_output_gate else 0  # the gate's projection
        return m.hidden_size * (q + gate + 2 * kv) + q * s + q * m.hidden_size
    h, r = m.hidden_size, m.kv_lora_rank
    dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    # Megatron's MLA terms, each latent norm counted as one multiply-add per channel.
    query = h * a * (dn + dr)
    if m.q_lora_rank is not None:
        query = m.q_lora_rank * (h + a * (dn + dr) + 1)
    projections = query + r * (h + a * (dn + dv) + 1) + h * dr + a * dv * h
    return projections + s * (a * (dn + dr) + a * dv) / 2


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


# The command line.


def main(argv: list[str] | None = None) -> int:
    """`mp-train estimate ...`: prints one JSON object; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "estimate":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(f"mp-train: unknown command {argv[0]!r}; commands: estimate", file=sys.stderr)
        return 2
    own, rest = _parser().parse_known_args(argv)
    from mp_train.configuration.arguments import (
        parse_config,  # the run's own flags and --config YAML
    )

    try:
        config = parse_config(rest, prog="mp-train estimate")
        result = estimate(config, own.world_size, vocab_size=own.vocab_size,
                          device_type=own.device,
                          megatron_formula=own.megatron_formula)  # fmt: skip
    except (OSError, ValueError) as error:
        print(f"mp-train estimate: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mp-train estimate",
        description="Theoretical memory of the most loaded rank and FLOPs per iteration. "
        "By default mp's own model: every parameter the run allocates, placed as its ranks "
        "hold it (replicated norms whole on each tensor-parallel rank), the optimizer state "
        "of its precision and optimizer, the activations its core attention, recompute, "
        "context parallelism, MoE widths and multi-token prediction keep, of the first or "
        "last pipeline stage, whichever holds more. With --megatron-formula, "
        f"Megatron-LM's figures instead ({MEGATRON_VERSION}). Every other flag (and "
        "--config FILE.yaml) is the run's own, mixture-of-experts layers included "
        "(--num-moe-experts, --moe-router-topk, --expert-model-parallel-size, ...) and "
        "Mamba-hybrid models (--hybrid-layer-pattern, --mamba-num-heads, ...).",
        allow_abbrev=False,
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the run")
    parser.add_argument("--vocab-size", type=int, help="vocabulary before padding")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the run computes (decides the core attention 'auto' "
                        "picks, hence whether attention probabilities are kept; no effect "
                        "with --megatron-formula, which keeps none)")  # fmt: skip
    parser.add_argument(
        "--megatron-formula", action="store_true",
        help=f"Megatron-LM's report_theoretical_memory and num_floating_point_operations "
        f"({MEGATRON_VERSION}), to the bit, with the lines Megatron prints "
        "(megatron_report). They assume bf16 weights with fp32 gradients and Adam (18 "
        "bytes a parameter; 6 + 12/dp with the distributed optimizer, dp without the "
        "context-parallel ranks); count no bias but the router's, no learned positions, "
        "and of an MTP module its layer only; take the first stage's L/p layers, the "
        "embedding and every MTP module as the most loaded rank; store the activations of "
        "the whole sequence in 16 bits, without the attention scores (as flash attention "
        "or selective recompute would), ffn_hidden_size wide in every layer (MoE and MLA "
        "layers as dense ones), without full recompute or MTP: sbh(18 + 4f/h)/t a layer "
        "with sequence parallelism and selective recompute, otherwise sbh(10 + 24/t) a "
        "layer and a 5%% margin. Refused for hybrid models (--hybrid-layer-pattern), "
        "which Megatron's report does not cover.",
    )  # fmt: skip
    return parser
