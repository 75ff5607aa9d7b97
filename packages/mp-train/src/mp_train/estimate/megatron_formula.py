"""`mp-train estimate --megatron-formula`: the figures megatron-core 0.19.2 reports for a
run, from mp's configuration: report_theoretical_memory (weights and optimizer,
activations, total, in MB; the lines it prints with verbose=True, after the first
iteration of pretrain_gpt.py) and num_floating_point_operations (one global batch).
tests/test_estimate_megatron.py checks every figure and printed line against Megatron's
own functions over Megatron-LM command lines (tests/assets/megatron_estimate).

What Megatron's formulas assume, where mp's own estimate (mp_train.estimate) counts
what the run holds instead:

- Weights: bf16 weights, fp32 gradients, an fp32 main copy and Adam's two moments,
  18 bytes a parameter whatever the run's precision and optimizer; with the
  distributed optimizer 6 + 12 / dp, dp being world / (t p c) (mp shards over the dp x c
  ranks the optimizer does). Expert parameters: 6 + 12 / (world / (expert-t e p)).
- Parameters: the weights of attention (Q, K, V and out; MLA's projections and both
  latent norms always), of the MLPs (x 3/2 with SwiGLU and GeGLU: quick_geglu's gate is not
  counted), the norms, the router (and its bias with add_bias_linear), the shared
  expert's gate and the embedding; no other bias, no learned position embedding. A
  multi-token prediction module counts its transformer layer only (not its two norms,
  its eh_proj or its final norm). The most loaded shard is the first stage's L / p
  layers (even when the stages are uneven), the word embedding and every MTP module (with
  p > 1 they sit on the last stage), plus the output layer when p = 1 and untied; norms
  and routers whole on every tensor-parallel rank, experts / (e x expert-t).
- Activations, in 16-bit, of the first stage with p micro-batches in flight (x (1 + (p -
  1) / (p v)) interleaved, x min(1, m / p) under 1F1B), the whole sequence (context
  parallelism not counted), ffn_hidden_size for every layer (MoE and MLA layers as dense
  ones), no MTP module, no full recompute. With sequence_parallel and selective recompute
  (compute_activation_memory): Korthikanti et al. 2022, Table 2, sbh(18 + 4f/h) / t a
  layer, its attention scores recomputed. Otherwise (compute_activation_memory_without_sp)
  sbh(10 + 24/t) a layer (f = 4h, the scores not stored, as flash attention or
  selective recompute would leave them), its own output-layer term and a 5% margin.
- FLOPs: mp's own count (see mp_train.estimate), computed in Megatron's floating point.
- Gated DeltaNet layers and the attention output gate (Qwen3-Next): megatron-core 0.19.2's
  report has no term for either and counts each such layer as softmax attention without a
  gate (the parameters above), and so does this; mp's own estimate counts what the layers
  hold (mp_train.estimate.linear_attention), and the FLOPs here are mp's own, theirs
  included.
- Hybrid models (hybrid_layer_pattern): refused. report_theoretical_memory prints "not yet
  supported for hybrid Mamba-Transformer models" and reports nothing; mp's own estimate
  counts their layers, with Megatron's hybrid FLOPs (mp_train.estimate.hybrid).

Every figure is computed in the order Megatron's code computes it, so that the floats are
Megatron's to the last bit and the printed lines Megatron's to the character.
"""

from __future__ import annotations

import math

from mp_train.configuration.config import RunConfig

__all__ = ["MEGATRON_VERSION", "megatron_estimate"]

MEGATRON_VERSION = "megatron-core 0.19.2"
_MB = 1024 * 1024


def megatron_estimate(config: RunConfig, layout: dict, V: int) -> dict:
    """The figures of Megatron's report (module docstring) for `config` on the ranks of
    `layout` (mp_train.estimate's), with V the padded vocabulary."""
    if config.model.hybrid_layer_pattern is not None:
        raise ValueError(
            f"hybrid_layer_pattern={config.model.hybrid_layer_pattern!r} with "
            f"--megatron-formula: {MEGATRON_VERSION}'s report_theoretical_memory has no "
            "hybrid form; leave out --megatron-formula for mp's own estimate"
        )
    report: list[str] = []
    params = _parameters(config, V, report)
    weights = _weight_and_optimizer(config, layout, params, report)
    activations, formula = _activations(config, layout, V, report)
    weight_mb, activation_mb = weights / _MB, activations / _MB
    total_mb = weight_mb + activation_mb
    report.append(
        f"Theoretical memory footprints: weight and optimizer={weight_mb:.2f} MB, "
        f"activation={activation_mb:.2f} MB, total={total_mb:.2f} MB"
    )
    return {
        "num_parameters": params["total"],
        "num_active_parameters": params["active"],
        "weight_and_optimizer_mb": weight_mb,
        "activation_mb": activation_mb,
        "total_mb": total_mb,
        "flops_per_iteration": _flops(config, layout["gbs"], V),
        "padded_vocab_size": V,
        "parameters_on_most_loaded_shard": params["most_loaded"],
        "activation_formula": formula,
        "data_parallel_size": layout["dp"],
        "global_batch_size": layout["gbs"],
        "num_microbatches": layout["microbatches"],
        "formula": MEGATRON_VERSION,
        "megatron_report": report,
    }


def _layer_kinds(config: RunConfig) -> tuple[int, int, int, int]:
    """(dense layers, MoE layers, dense MTP layers, MoE MTP layers): an MTP module's layer
    is of the kind of the model's last layer."""
    m = config.model
    pattern = [int(moe) for moe in m.moe_layer_pattern()]
    n_moe = sum(pattern)
    mtp = m.mtp_num_layers or 0
    return m.num_layers - n_moe, n_moe, (1 - pattern[-1]) * mtp, pattern[-1] * mtp


def _attention(config: RunConfig, norm: int) -> float:
    """One layer's attention weights (the norm term: parameters per latent-norm channel,
    1 in the FLOPs)."""
    m = config.model
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        dn, dr, dv, r = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
        query = h * a * (dn + dr)
        if m.q_lora_rank is not None:
            query = m.q_lora_rank * (h + a * (dn + dr) + norm)
        return query + r * (h + a * (dn + dv) + norm) + h * dr + (a * dv) * h
    ratio = m.kv_channels * a / h
    return 2 * h * h * ((1 + (m.num_query_groups / a)) * ratio)


def _parameters(config: RunConfig, V: int, report: list[str]) -> dict:
    m = config.model
    h = m.hidden_size
    E = m.num_moe_experts
    gated = 3 / 2 if m.activation in ("swiglu", "geglu") else 1
    shared = m.moe_shared_expert_intermediate_size or 0
    n_dense, n_moe, mtp_dense, mtp_moe = _layer_kinds(config)
    moe_f = m.moe_ffn_hidden_size if E is not None else 0
    norm = 1 if m.normalization == "RMSNorm" else 2
    embedding = h * V
    final_norm = norm * h
    embeddings = 2 * embedding if m.untie_embeddings_and_output_weights else embedding
    attention = _attention(config, norm)
    mlp = 2 * h * m.ffn_hidden_size * gated
    shared_mlp = 2 * h * shared * gated
    routed = 2 * h * moe_f * (1 if E is None else E) * gated
    active_routed = 2 * h * moe_f * m.moe_router_topk * gated if E is not None else 0
    norms = 2 * h * norm
    router = (h * E) + (E if m.add_bias_linear else 0) if E is not None else 0
    gate = h if shared > 0 and m.moe_shared_expert_gate else 0
    dense_layer = attention + mlp + norms
    moe_layer = attention + shared_mlp + routed + 0 + norms + router + gate
    active_moe_layer = attention + shared_mlp + active_routed + 0 + norms + router + gate
    block = dense_layer * n_dense + moe_layer * n_moe + final_norm
    active_block = dense_layer * n_dense + active_moe_layer * n_moe + final_norm
    mtp_block = dense_layer * mtp_dense + moe_layer * mtp_moe
    total = block + mtp_block + embeddings
    active = active_block + mtp_block + embeddings
    report += [
        f"Number of parameters in transformer block in billions: {block / 10**9: .2f}",
        "Number of active parameters in transformer block in billions: "
        f"{active_block / 10**9: .2f}",
    ]
    if m.mtp_num_layers is not None:
        report.append(f"Number of parameters in mtp block in billions: {mtp_block / 10**9: .2f}")
    report += [
        f"Number of parameters in embedding layers in billions: {embeddings / 10**9:.2f}",
        f"Total number of parameters in billions: {total / 10**9:.2f}",
        f"Total number of active parameters in billions: {active / 10**9:.2f}",
    ]
    # By how a rank holds them: split over t, whole (norms, routers), or split over
    # expert-t x e (the routed experts).
    replicated_moe = norms + 0 + router + gate
    return {
        "total": total, "active": active, "embedding": embedding,
        "split": (attention + mlp) * n_dense + (attention + shared_mlp) * n_moe,
        "whole": norms * n_dense + replicated_moe * n_moe + final_norm,
        "experts": routed * n_moe,
        "mtp_split": (attention + mlp) * mtp_dense + (attention + shared_mlp) * mtp_moe,
        "mtp_whole": norms * mtp_dense + replicated_moe * mtp_moe,
        "mtp_experts": routed * mtp_moe,
    }  # fmt: skip


def _weight_and_optimizer(config: RunConfig, layout: dict, params: dict, report: list) -> float:
    tp, pp = layout["tp"], layout["pp"]
    expert_ranks = layout["etp"] * layout["ep"]
    expert_dp = layout["world_size"] // (expert_ranks * pp)
    split = ((params["split"] / pp) + params["mtp_split"] + params["embedding"]) / tp
    whole = (params["whole"] / pp) + params["mtp_whole"]
    experts = ((params["experts"] / pp) + params["mtp_experts"]) / expert_ranks
    most_loaded = split + whole + experts
    if config.model.untie_embeddings_and_output_weights and pp == 1:
        split += params["embedding"] / tp
        most_loaded += params["embedding"] / tp
    params["most_loaded"] = most_loaded
    report.append(
        f"Number of parameters in most loaded shard in billions: {most_loaded / 10**9:.4f}"
    )
    if pp > 1:
        others = (
            params["split"] / (pp * tp) + params["whole"] / pp
            + params["experts"] / (pp * expert_ranks)
        )  # fmt: skip
        report.append(f"Number of parameters in other shards in billions: {others / 10**9:.4f}")

    def bytes_per_parameter(data_parallel_size: int) -> float:
        if not config.optimizer.use_distributed_optimizer:
            return 18
        return 6 + (12 / data_parallel_size)

    return (split + whole) * bytes_per_parameter(layout["dp"]) + experts * bytes_per_parameter(
        expert_dp
    )


def _activations(config: RunConfig, layout: dict, V: int, report: list) -> tuple[float, str]:
    m = config.model
    s, b, h = config.gpt.seq_length, config.training.micro_batch_size, m.hidden_size
    tp, pp, vpp = layout["tp"], layout["pp"], layout["vpp"]
    with_sp = m.sequence_parallel and m.recompute_granularity == "selective"
    if with_sp:
        name = "compute_activation_memory with SP"
        total = (s * b * h) * (18 + (4 * (m.ffn_hidden_size / h)))
        report += [name, "Activation memory footprint per transformer layer: "
                   f"{total / _MB / tp:.1f} MB"]  # fmt: skip
    else:
        name = "compute_activation_memory_without_sp"
        total = s * b * h * (10 + (24 / tp))
        report += [name, "Activation memory footprint per transformer layer (precise, "
                   f"without SP): {total / _MB:.1f} MB"]  # fmt: skip
    total *= m.num_layers
    total += 8 * s * b * pp  # the token ids, p micro-batches in flight
    total += s * b * h * pp  # the embedding's dropout
    if vpp is not None:
        penalty = 1 + ((pp - 1) / (pp * vpp))
        report += [f"Memory penalty from interleaved schedule: {penalty:.2f}",
                   f"Number of in-flight microbatches: {math.ceil(penalty * pp)}"]  # fmt: skip
        total *= penalty
    elif pp > 1:
        microbatches = layout["microbatches"]
        total *= min(1, microbatches / pp)
        report.append(f"Number of in-flight microbatches: {min(microbatches, pp)}")
    if with_sp:
        if pp == 1:  # the output layer's input and the cross entropy's
            total += s * b * h * 4 * (1 + (V / h))
        return total / tp, name
    if pp == 1:
        logits = s * b * V
        logits /= tp
        total += (logits + s * b * h) * 2
    return total * 1.05, name


def _flops(config: RunConfig, gbs: int, V: int) -> float:
    """num_floating_point_operations(args, gbs) for a transformer of `config`."""
    m = config.model
    s, h = config.gpt.seq_length, m.hidden_size
    n_dense, n_moe, mtp_dense, mtp_moe = _layer_kinds(config)
    n_dense, n_moe = n_dense + mtp_dense, n_moe + mtp_moe
    mtp = m.mtp_num_layers or 0
    layers = m.num_layers + mtp
    k = m.moe_router_topk if m.num_moe_experts is not None else 0
    shared = m.moe_shared_expert_intermediate_size or 0
    gated = 3 if m.activation in ("swiglu", "geglu") else 2
    a = m.num_attention_heads
    if m.multi_latent_attention:
        projections = 3 * 2 * _attention(config, 1)
        dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        scores = 3 * 2 * (a * (dn + dr) / 2 + a * dv / 2)
    else:
        q, kv = m.kv_channels * a, m.kv_channels * m.num_query_groups
        projections = 3 * 2 * (h * (q + kv + kv + 0) + q * h)
        scores = 3 * 2 * q / 2 * 2  # QK^T and its product with V, half under the causal mask
    mlp = (
        (m.ffn_hidden_size * gated) * n_dense
        + (m.moe_ffn_hidden_size or m.ffn_hidden_size) * k * gated * n_moe
        + (shared * gated) * n_moe
    )
    per_token = (
        3 * 2 * h * mlp
        + (0 * 0 + projections * layers)
        + 3 * 2 * mtp * (3 * h + 2 * h * h)  # the MTP modules' norms and eh_proj
        + 3 * 2 * h * V * (mtp + 1)  # the logits, once per MTP module and once more
    )
    return (gbs * s) * per_token + (gbs * s * s) * (scores * layers)
