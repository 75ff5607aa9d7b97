"""Theoretical memory of the most loaded rank and FLOPs per iteration, from the configuration alone.

    mp-train estimate [--config FILE.yaml] [overrides...] --world-size N [--vocab-size V]
        [--device cuda|cpu]

prints one JSON object and starts no process. Every option of the run applies; a
mixture-of-experts model is described by the model's own fields (num_moe_experts,
moe_router_topk, moe_ffn_hidden_size, moe_shared_expert_intermediate_size,
moe_shared_expert_gate, moe_layer_freq) and the layout by expert_model_parallel_size and
expert_tensor_parallel_size. Symbols: s sequence, b micro-batch, h hidden, a heads, g
query groups, d head width (kv_channels), f ffn width, L layers, V padded vocabulary,
t/p/c/e tensor/pipeline/context/expert parallel sizes, m micro-batches per iteration, B
global batch; for MoE layers E routed experts, k of them per token, f_moe their width,
f_shared the shared expert's. MB is 2^20 bytes.

Parameters (Megatron-LM's compute_weight_and_optimizer_memory): per layer attention
2hd(a + g), MLP hf x (3 if gated (swiglu, quick_geglu) else 2), norms 2h x (2 for
LayerNorm, 1 for RMSNorm); a MoE layer's MLP is h(E f_moe + f_shared) x (3|2), plus its
router hE and, with moe_shared_expert_gate, the gate's h (Megatron leaves both out; they
are trained and saved like any weight); final norm; embedding hV, doubled when untied.
Multi-latent attention (r kv_lora_rank, r_q q_lora_rank, dn qk_head_dim, dr
qk_pos_emb_head_dim, dv v_head_dim) has r_q(h + a(dn + dr)) for its queries (ha(dn + dr)
without r_q), r(h + a(dn + dv)) + h dr for keys and values and a dv h for its output,
plus the latent norms' r_q and r with qk_layernorm (Megatron counts them always).
The biases of attention and dense MLPs and learned position embeddings are not counted
(as in Megatron); a MoE layer's, with add_bias_linear, are, like its router: the router's
E and the routed experts' E(f_moe x (2|1) + h) (gpt-oss), counted with the experts.
num_active_parameters
counts the k routed experts a token passes through instead of all E. The most loaded
rank holds (block / p + hV) / t, plus the output layer's hV / t when p = 1 and untied;
routed experts are divided by e x expert-t instead of t (Megatron ignores expert
parallelism here). Norms, the router and the gate are in truth whole on every
tensor-parallel rank; like Megatron's norms they are counted / t (a few h per layer).

Bytes per parameter: weight + gradient + optimizer state (fp32 main copy under mixed
precision, Adam's two moments or SGD's momentum). bf16/fp16 with fp32 gradients and Adam
is Megatron's 2 + 4 + 12 = 18, and 6 + 12 / dp with the distributed optimizer, which
shards only the optimizer state, over dp x c ranks (experts: their data-parallel ranks).

Activations of the first pipeline stage (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2, with f generalised as Megatron
does): one layer and micro-batch stores 10sbh that tensor parallelism leaves whole
(norm inputs, QKV and fc1 inputs, dropout masks), sbh(8 + 4f/h) it splits, and the
attention scores 5as^2b unless core attention is recomputed (selective):

    sequence parallel + selective   sbh(18 + 4f/h) / t         Megatron's compute_activation_memory
    sequence parallel               (sbh(18 + 4f/h) + 5as^2b) / t
    selective                       sbh(10 + (8 + 4f/h) / t)   (f = 4h: Megatron's sbh(10 + 24/t))
    no recompute                    sbh(10 + (8 + 4f/h) / t) + 5as^2b / t
    full recompute                  2sbh (/ t with sequence parallel) per checkpointed input,
                                    plus one recomputed group's activations during backward

times L (p micro-batches in flight x L / p layers), plus the embedding's 8sb + sbh per
in-flight micro-batch; all of it x (1 + (p - 1) / (p v)) under the interleaved schedule,
or x min(1, m / p) under 1F1B; plus the output layer's 4sbh + 4sbV when p = 1 (4cV
for the logits of a chunk of c < sb tokens with output_loss_chunk_tokens c). Under
sequence parallelism every term is divided by t, otherwise only the split ones. Megatron
itself reports only the first form; for every other case it uses sbh(10 + 24/t), its
own output-layer term and a 5% margin. Context parallelism stores s / c tokens per rank;
the scores are a (s / c) s b. MoE layers replace f by k f_moe + f_shared (Megatron uses f
everywhere); the router's logits and the dispatcher's buffers are not counted.
The score term counts what mp's core attention keeps: blocked attention ("local",
"unfused", or "auto" on a CPU within its memory limit) keeps the causal blocks of its
probabilities, 5 bytes a score with dropout and 2 without; SDPA (flash attention) and the
context-parallel ring and all-gather blocks keep none; all-to-all context parallelism
attends over the whole sequence with a / c heads. The coefficients count 16-bit
activations; an fp32 model doubles them.

FLOPs (Megatron-LM's num_floating_point_operations): forward + backward is 3 GEMMs per
weight and a GEMM of (m x n)(n x k) is 2mnk, so per token and layer
6[h(ad + 2gd) + ad s + ad h] for attention (the causal mask halves QK^T and its product
with V), 6hf x (3|2) for a dense MLP, 6h(k f_moe + f_shared) x (3|2) for a MoE one, and
6hV for the logits; times B s (the router's 6hE per token and MoE layer is left out, as
Megatron does). They are the model's FLOPs: recomputation (activation recompute, the
chunked output loss's second logits GEMM) is not counted, as in Megatron's MFU.
With a = g, f = 4h it is 72BsLh^2(1 + s/(12h) + V/(12Lh)). Multi-latent
attention's per token and layer, Megatron's MLA branch: 6[r_q(h + a(dn + dr) + 1) + r(h +
a(dn + dv) + 1) + h dr + a dv h + s a(dn + dr + dv)/2] (r_q(...) is ha(dn + dr) without a
query latent; the + 1 counts each latent norm). Its activations are estimated with the
formula above, as Megatron does (h for the widths the layer keeps).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from mp_layers import TransformerConfig, keeps_attention_probabilities, saved_probability_bytes
from mp_pipeline import stage_layers
from mp_train.config import RunConfig

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
) -> dict:
    """num_parameters, weight_and_optimizer_mb, activation_mb, total_mb (most loaded rank)
    and flops_per_iteration (one global batch, forward + backward), with the figures they
    are made of. A MoE model (config.model.num_moe_experts) is read from the model's fields
    and config.parallel's expert sizes. `vocab_size` overrides config.data.vocab_size;
    `device_type` ("cuda" or "cpu") is where the run computes, which decides the core
    attention "auto" picks."""
    layout = _layout(config, world_size)
    vocab = vocab_size if vocab_size is not None else config.data.vocab_size
    V = config.data.padded_vocab_size
    if V is None:
        if vocab is None:
            raise ValueError("no vocabulary size: set vocab_size (--vocab-size) or "
                             "padded_vocab_size; the tokenizer is not read")  # fmt: skip
        _positive("vocab_size", vocab)
        V = padded_vocab_size(vocab, config.data.make_vocab_size_divisible_by, layout["tp"])
    params = _parameters(config, V)
    weights = _weight_and_optimizer(config, layout, params)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r} must be cuda or cpu")
    activation_bytes, formula = _activation_bytes(config, layout, V, device_type)
    weight_mb = weights["bytes"] / _MB
    activation_mb = activation_bytes / _MB
    return {
        "num_parameters": params["total"],
        "num_active_parameters": params["active"],
        "weight_and_optimizer_mb": weight_mb,
        "activation_mb": activation_mb,
        "total_mb": weight_mb + activation_mb,
        "flops_per_iteration": _flops(config, layout, V),
        "padded_vocab_size": V,
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
    model.check_parallel(tp, cp, ep, etp)
    first = parallel.decoder_first_pipeline_num_layers
    last = parallel.decoder_last_pipeline_num_layers
    if first is None and last is None and model.num_layers % (pp * (vpp or 1)):
        raise ValueError(
            f"num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size="
            f"{pp} x virtual_pipeline_model_parallel_size={vpp or 1}"
        )
    # every stage's share (refused, naming the stage, when it does not split)
    stages = [stage_layers(model.num_layers, pp, rank, virtual_pipeline_model_parallel_size=vpp,
                           num_layers_in_first_pipeline_stage=first,
                           num_layers_in_last_pipeline_stage=last).count * (vpp or 1)
              for rank in range(pp)]  # fmt: skip
    seq = config.gpt.seq_length
    if seq % cp:
        raise ValueError(f"context_parallel_size={cp} does not divide seq_length={seq}")
    mbs = training.micro_batch_size
    gbs = training.global_batch_size if training.global_batch_size is not None else mbs * dp
    if mbs < 1 or gbs % (mbs * dp):
        raise ValueError(
            f"global_batch_size={gbs} is not divisible by micro_batch_size={mbs} x "
            f"data_parallel_size={dp} (world size {world_size})"
        )
    if config.optimizer.bf16 != model.bf16 or config.optimizer.fp16 != model.fp16:
        raise ValueError(
            f"the model (bf16={model.bf16}, fp16={model.fp16}) and the optimizer "
            f"(bf16={config.optimizer.bf16}, fp16={config.optimizer.fp16}) disagree on the "
            "precision"
        )
    # Expert layers re-divide each stage's t x c x dp ranks as expert-t x e x expert-dp.
    edp = parallel.expert_data_parallel_size(world_size) if model.num_moe_experts else dp * cp
    return {
        "tp": tp, "pp": pp, "cp": cp, "vpp": vpp, "dp": dp, "ep": ep, "etp": etp, "edp": edp,
        "gbs": gbs, "microbatches": gbs // (mbs * dp), "first_stage_layers": stages[0],
    }  # fmt: skip


def _moe_layers(config: RunConfig) -> tuple[int, int]:
    """(dense layers, MoE layers)."""
    n_moe = sum(config.model.moe_layer_pattern())
    return config.model.num_layers - n_moe, n_moe


def _parameters(config: RunConfig, V: int) -> dict:
    """Every parameter the model holds: the weights of Megatron's formula and the small
    ones beside them (biases, norms, qk-layernorm, attention sinks, learned positions), so
    that the total equals GPTModel's count for every family."""
    m = config.model
    h = m.hidden_size
    gated = 3 if m.gated_linear_unit else 2  # fc1 (twice as wide when gated) and fc2
    norm = 1 if m.normalization == "RMSNorm" else 2  # LayerNorm has a bias
    attention = _attention_parameters(m, norm)
    n_dense, n_moe = _moe_layers(config)
    mlp = h * m.ffn_hidden_size * gated
    if m.add_bias_linear:
        mlp += m.ffn_hidden_size * (gated - 1) + h
    dense_layer = attention + mlp + 2 * h * norm
    block = dense_layer * n_dense + norm * h  # and the final norm
    experts = active_experts = 0
    if n_moe:
        E, k = m.num_moe_experts, m.moe_router_topk
        shared = h * (m.moe_shared_expert_intermediate_size or 0) * gated
        router = h * E + (h if m.moe_shared_expert_gate else 0)  # and the shared expert's gate
        expert = h * m.moe_ffn_hidden_size * gated
        if m.add_bias_linear:  # the router's bias [E]; each expert's fc1 [(2|1) f] and fc2 [h]
            router += E
            expert += m.moe_ffn_hidden_size * (gated - 1) + h
        experts = expert * E * n_moe
        active_experts = experts // E * k
        block += (attention + shared + router + 2 * h * norm) * n_moe + experts
    embedding = h * V
    embeddings = 2 * embedding if m.untie_embeddings_and_output_weights else embedding
    if m.position_embedding_type == "learned_absolute":
        embeddings += h * (config.gpt.max_position_embeddings or config.gpt.seq_length)
    total = block + embeddings
    return {
        "total": total, "active": total - experts + active_experts, "block": block,
        "experts": experts, "embedding": embedding,
    }  # fmt: skip


def _attention_parameters(m: TransformerConfig, norm: int) -> int:
    """One layer's attention parameters; norm: parameters per normalized channel."""
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        return _mla_parameters(m, norm)
    d, g = m.kv_channels, m.num_query_groups
    attention = 2 * h * d * (a + g)  # Q, K, V and out
    if m.add_bias_linear or m.add_qkv_bias:
        attention += d * (a + 2 * g)
    if m.add_bias_linear:
        attention += h  # the output projection's bias
    if m.qk_layernorm:
        attention += 2 * d * norm
    if m.softmax_type == "learnable":
        attention += a  # one sink logit per head
    return attention


def _mla_parameters(m: TransformerConfig, norm: int) -> int:
    """Multi-latent attention's: the query projection (or its down and up projections and
    latent norm), the key/value down projection [r + dr, h], its latent norm and up
    projection [a (dn + dv), r], the output projection [h, a dv] and its bias; the latent
    norms only when qk_layernorm builds them (Megatron's formula counts them always)."""
    h, a, r = m.hidden_size, m.num_attention_heads, m.kv_lora_rank
    dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    latent_norm = norm if m.qk_layernorm else 0
    if m.q_lora_rank is None:
        query = h * a * (dn + dr)
    else:
        query = m.q_lora_rank * (h + a * (dn + dr) + latent_norm)
    key_value = r * (h + a * (dn + dv) + latent_norm) + h * dr
    return query + key_value + a * dv * h + (h if m.add_bias_linear else 0)


def _weight_and_optimizer(config: RunConfig, layout: dict, params: dict) -> dict:
    tp, pp = layout["tp"], layout["pp"]
    # Megatron's most loaded shard: the first stage's layers and the embedding; with one
    # stage also the untied output layer.
    shard = ((params["block"] - params["experts"]) / pp + params["embedding"]) / tp
    if config.model.untie_embeddings_and_output_weights and pp == 1:
        shard += params["embedding"] / tp
    expert_shard = params["experts"] / pp / (layout["ep"] * layout["etp"])
    weight, grad, state = _bytes_per_parameter(config)
    if config.optimizer.use_distributed_optimizer:
        # Megatron shards over the data-parallel group that includes the context ranks.
        dense_bytes = weight + grad + state / (layout["dp"] * layout["cp"])
        expert_bytes = weight + grad + state / layout["edp"]
    else:
        dense_bytes = expert_bytes = weight + grad + state
    return {
        "shard": shard,
        "expert_shard": expert_shard,
        "bytes_per_parameter": dense_bytes,
        "bytes": shard * dense_bytes + expert_shard * expert_bytes,
    }


def _bytes_per_parameter(config: RunConfig) -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes of one parameter."""
    optimizer = config.optimizer
    mixed = optimizer.bf16 or optimizer.fp16
    weight = 2 if mixed else 4
    grad = 4 if optimizer.grad_reduce_in_fp32 or not mixed else 2
    sgd_moments = 4 if optimizer.sgd_momentum > 0 else 0
    moments = 8 if optimizer.optimizer == "adam" else sgd_moments
    return weight, grad, (4 if mixed else 0) + moments


def _activation_bytes(
    config: RunConfig, layout: dict, V: int, device_type: str
) -> tuple[float, str]:
    """Activation bytes of the first pipeline stage (see the module docstring)."""
    m = config.model
    tp, pp, vpp = layout["tp"], layout["pp"], layout["vpp"]
    s_full = config.gpt.seq_length
    s = s_full / layout["cp"]  # tokens of a sequence on one rank
    b, h = config.training.micro_batch_size, m.hidden_size
    L = m.num_layers
    n_dense, n_moe = _moe_layers(config)
    f = m.ffn_hidden_size
    if n_moe:
        moe_f = m.moe_router_topk * m.moe_ffn_hidden_size
        moe_f += m.moe_shared_expert_intermediate_size or 0
        f = (n_dense * f + n_moe * moe_f) / L
    sp, granularity = m.sequence_parallel, m.recompute_granularity
    sbh = s * b * h

    def stored(whole: float, split: float) -> float:
        return (whole + split) / tp if sp else whole + split / tp

    scores = _score_bytes(config, layout, b, device_type)
    layer = stored(10 * sbh, (8 + 4 * f / h) * sbh + scores)
    transient = 0.0
    if granularity == "full":
        chunk = layout["first_stage_layers"] // (vpp or 1)  # layers of one model chunk
        n = min(m.recompute_num_layers, chunk)
        checkpoint = stored(2 * sbh, 0)  # each recomputed group keeps only its input
        if m.recompute_method == "uniform":
            per_layer = checkpoint * math.ceil(chunk / n) / chunk
        else:  # block: the first n layers of each chunk, one layer at a time
            per_layer = (n * checkpoint + (chunk - n) * layer) / chunk
            n = 1
        transient = n * layer  # the group being recomputed, one micro-batch
        layer = per_layer
    # the first stage's layers, each with up to pp micro-batches in flight (L with an even split)
    total = layer * layout["first_stage_layers"] * pp
    total += stored(8 * s * b + sbh, 0) * pp  # token ids, embedding dropout mask
    if vpp is not None:
        total *= 1 + (pp - 1) / (pp * vpp)
    elif pp > 1:
        total *= min(1.0, layout["microbatches"] / pp)
    if pp == 1:
        # The output layer's input and logits: one chunk's with output_loss_chunk_tokens.
        tokens = min(s * b, m.output_loss_chunk_tokens or s * b)
        total += stored(4 * sbh, 4 * tokens * V)
    recompute = {None: "no recompute", "selective": "selective recompute"}.get(
        granularity, f"full recompute ({m.recompute_method})"
    )
    formula = ("sequence parallel, " if sp else "") + recompute
    # The coefficients count 16-bit activations (bf16/fp16 runs, as Megatron's); an fp32
    # model keeps every activation at twice the size.
    width = 1 if m.bf16 or m.fp16 else 2
    return (total + transient) * width, formula


def _score_bytes(config: RunConfig, layout: dict, b: int, device_type: str) -> float:
    """The attention probabilities one layer keeps for backward on the most loaded rank,
    before the tensor-parallel split: 5 bytes per kept score with dropout (softmax output,
    dropout output, mask: Megatron's 5as^2b), 2 without; none where the core attention
    keeps none (see the module docstring)."""
    m = config.model
    if m.recompute_granularity == "selective":
        return 0.0
    cp, tp = layout["cp"], layout["tp"]
    if cp > 1 and m.cp_comm_type != "a2a":
        return 0.0  # ring and all-gather blocks keep their outputs and log-sum-exps only
    s = config.gpt.seq_length  # a2a attends over the whole sequence with a / cp heads
    heads = m.num_attention_heads // cp
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    explicit = config.data.batches_carry_attention_mask
    if not keeps_attention_probabilities(m.attention_backend, device_type, s, b, heads // tp,
                                         dtype, explicit_mask=explicit):  # fmt: skip
        return 0.0
    kept = saved_probability_bytes(s, b, heads, 1, causal=not explicit)
    return (5 if m.attention_dropout > 0 else 2) * kept


def _flops(config: RunConfig, layout: dict, V: int) -> int:
    m = config.model
    s, h, L = config.gpt.seq_length, m.hidden_size, m.num_layers
    gated = 3 if m.gated_linear_unit else 2
    attention = _attention_flops(m, s)
    n_dense, n_moe = _moe_layers(config)
    mlp = m.ffn_hidden_size * gated * n_dense
    if n_moe:
        routed = m.moe_ffn_hidden_size * m.moe_router_topk
        mlp += (routed + (m.moe_shared_expert_intermediate_size or 0)) * gated * n_moe
    per_token = 3 * 2 * (h * mlp + attention * L + h * V)  # fwd + 2 bwd GEMMs, 2 per multiply-add
    return layout["gbs"] * s * per_token


def _attention_flops(m: TransformerConfig, s: int) -> float:
    """One layer's attention multiply-adds per token, Megatron's num_floating_point_operations:
    the projections, and QK^T and (QK^T)V at half (the causal mask)."""
    a = m.num_attention_heads
    if not m.multi_latent_attention:
        q = m.kv_channels * a
        kv = m.kv_channels * m.num_query_groups
        return m.hidden_size * (q + 2 * kv) + q * s + q * m.hidden_size
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
    from mp_train.arguments import parse_config  # the run's own flags and --config YAML

    try:
        config = parse_config(rest, prog="mp-train estimate")
        result = estimate(config, own.world_size, vocab_size=own.vocab_size,
                          device_type=own.device)  # fmt: skip
    except (OSError, ValueError) as error:
        print(f"mp-train estimate: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mp-train estimate",
        description="Theoretical memory of the most loaded rank and FLOPs per iteration. "
        "Every other flag (and --config FILE.yaml) is the run's own, mixture-of-experts "
        "layers included (--num-moe-experts, --moe-router-topk, --expert-model-parallel-size, "
        "...).",
        allow_abbrev=False,
    )
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the run")
    parser.add_argument("--vocab-size", type=int, help="vocabulary before padding")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the run computes (decides the core attention 'auto' "
                        "picks, hence whether attention probabilities are kept)")  # fmt: skip
    return parser
