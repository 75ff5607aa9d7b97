"""Benchmark: training tokens/s of a Mixtral-style MoE GPTModel beside a plain loop over
transformers' MixtralForCausalLM.

One process, both cores (torch.set_num_threads(os.cpu_count())), bf16. The model:
LLAMA_SHAPE's attention and vocabulary (hidden 512, 8 layers, 8 heads in 4 query
groups of 64 channels, RMSNorm, RoPE, no biases, untied embeddings, vocabulary
32,000), every MLP a mixture of 8 SwiGLU experts of inner width 688 with top-2
softmax routing (Mixtral's rule: the top 2 of the softmax, renormalized), no
capacity limit, the load-balancing loss with coefficient 1e-2, dropout 0. A token
passes through 2 experts of width 688, as many MLP weights as the dense model's
ffn 1376: about 56M active parameters of 107M (both printed).

Ours: mp_layers.GPTModel (num_moe_experts=8, moe_router_topk=2,
moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True: the experts' matmuls are
torch._grouped_mm) with bf16 parameters, wrapped in mp_optim's
DistributedDataParallel (fp32 gradient buffers) and stepped by mp_optim's
MixedPrecisionOptimizer (fp32 main parameters, AdamW, global-norm clipping to
1.0): Megatron's bf16 mixed precision, as `--bf16` trains in bench_gpt.py. An
iteration: zero the gradient buffers, forward with labels -> mean per-token
loss -> backward (the routers' auxiliary losses add their gradients in it) ->
finish_grad_sync -> optimizer step.

The baseline is the loop one writes by hand over transformers'
MixtralForCausalLM of the same shape (its default experts implementation,
grouped_mm, and SDPA attention; output_router_logits=True,
router_aux_loss_coef=1e-2, router_jitter_noise=0), with the same precision
treatment and work as bench_gpt.py's: bf16 parameters (no autocast), their
gradients copied into fp32 main parameters stepped by torch.optim.AdamW (its
default implementation; the same settings and parameter groups: no weight
decay on 1-D parameters), global-norm clipping to 1.0, the updated values
copied back. Its loss is transformers' own: cross entropy plus 1e-2 times
its load-balancing loss (computed over all layers' router logits at once;
ours is Megatron's, one per layer, summed).

Both sides train on the same tokens: sequences counting up from a random start
(token t + 1 follows token t, modulo the vocabulary), the labels the next tokens
(no shift inside transformers: shift_labels); the losses of every iteration
are printed side by side (the language-model loss alone on both: transformers'
minus its coefficient times its aux_loss).

Both models stay alive side by side: each round runs ours for warm-up + timed
iterations, then the baseline for as many; tokens/s comes from the fastest
timed iteration of each over all rounds, the median beside it (other processes
on the machine lengthen single iterations of either side). Target: ours >= 1.5x
the baseline.

MFU counts the active parameters: per token, 6 FLOPs per active matmul weight
(the attention projections, the router, 2 experts, the output layer; the
embedding lookup is no matmul) plus causal attention, 6 L s nq d (the scores and
the weighted sum, half of the s x s square, forward and backward), over the
measured peak of a bf16 n x n matmul (mp_train.metrics.measure_peak_tflops, the
best of measures before the runs, before each round and after the runs).

    uv run python ci/bench/bench_moe.py [--seq 2048 --batch 1 --rounds 4 --warmup 1 --iters 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from harness import LLAMA_SHAPE, context, emit

from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import RankGroup
from mp_train.metrics import measure_peak_tflops

HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, _, VOCAB = LLAMA_SHAPE
EXPERTS, TOPK, EXPERT_FFN = 8, 2, 688
AUX_LOSS_COEFF = 1e-2
TARGET_RATIO = 1.5
LR, WEIGHT_DECAY, CLIP_GRAD = 1e-3, 0.01, 1.0
ONE_RANK = RankGroup("dp", (0,), 0, None)

Step = Callable[[torch.Tensor, torch.Tensor], float]
"""One training iteration on (tokens, labels) [b, s]; returns the loss."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per iteration")
    parser.add_argument("--expert-ffn", type=int, default=EXPERT_FFN, help="experts' width")
    parser.add_argument("--rounds", type=int, default=4, help="turns of ours, then baseline")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per turn")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per turn")
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the n x n matmul peak")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ctx = context()

    peak = measure_peak_tflops(args.peak_n) * 1e12
    counts = parameter_counts(args.expert_ffn)
    print(f"parameters: {counts['active']:,} active of {counts['total']:,}", flush=True)
    tokens = args.batch * args.seq
    flops = tokens * (6 * counts["active_matmul"] + 6 * LAYERS * args.seq * HEADS * HEAD_DIM)

    steps = {"ours": _ours(args.seq, args.expert_ffn), "hf": _hf(args.seq, args.expert_ffn)}
    params = {"ours": _count(steps["ours"]), "hf": _count(steps["hf"])}
    hf_config = steps["hf"].model.config  # what transformers chose by default
    if params["ours"] != counts["total"] or params["hf"] != counts["total"]:
        raise RuntimeError(f"parameters {params}, expected {counts['total']} on both sides")
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    losses: dict[str, list[float]] = {"ours": [], "hf": []}
    batches = _batches(args.batch, args.seq)
    per_turn = args.warmup + args.iters
    for round_ in range(args.rounds):
        peak = max(peak, measure_peak_tflops(args.peak_n) * 1e12)
        for name, step in steps.items():
            for i in range(per_turn):
                tokens_, labels = batches(round_ * per_turn + i)
                start = time.perf_counter()
                losses[name].append(step(tokens_, labels))
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
            print(f"round {round_} {name}: {[round(t, 2) for t in times[name][-args.iters:]]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    # Measured before each round and at the end: the best is the machine's (another
    # process running during a measure lowers it).
    peak = max(peak, measure_peak_tflops(args.peak_n) * 1e12)
    emit("matmul_peak[bf16]", {"tflops": round(peak / 1e12, 4), "n": args.peak_n}, ctx)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = best["hf"] / best["ours"]
    shape = {
        "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "query_groups": GROUPS,
        "experts": EXPERTS, "topk": TOPK, "expert_ffn": args.expert_ffn, "vocab": VOCAB,
        "sequence_length": args.seq, "batch": args.batch, "rounds": args.rounds,
        "warmup_per_turn": args.warmup, "timed_per_turn": args.iters,
        "precision": "bf16 parameters, fp32 gradients and main parameters (both)",
    }  # fmt: skip
    emit(
        "moe_train_iteration[bf16]",
        {
            "tokens_per_s": round(tokens / best["ours"], 1),
            "hf_tokens_per_s": round(tokens / best["hf"], 1),
            "tokens_per_s_median": round(tokens / median["ours"], 1),
            "hf_tokens_per_s_median": round(tokens / median["hf"], 1),
            "ratio_to_hf": round(ratio, 3),
            "ratio_to_hf_median": round(median["hf"] / median["ours"], 3),
            "target_ratio": TARGET_RATIO,
            "meets_target": ratio >= TARGET_RATIO,
            "iteration_s": [round(t, 3) for t in times["ours"]],
            "hf_iteration_s": [round(t, 3) for t in times["hf"]],
            "mfu": round(flops / best["ours"] / peak, 3),
            "hf_mfu": round(flops / best["hf"] / peak, 3),
            "achieved_tflops": round(flops / best["ours"] / 1e12, 4),
            "hf_achieved_tflops": round(flops / best["hf"] / 1e12, 4),
            "matmul_peak_tflops": round(peak / 1e12, 4),
            "flops_per_iteration": flops,
            "losses": [round(x, 3) for x in losses["ours"]],
            "hf_losses": [round(x, 3) for x in losses["hf"]],
            "active_parameters": counts["active"],
            "parameters": params["ours"],
            "hf_parameters": params["hf"],
            "hf_experts_implementation": hf_config._experts_implementation,
            "hf_attn_implementation": hf_config._attn_implementation,
            **shape,
        },
        ctx,
    )


def parameter_counts(expert_ffn: int) -> dict[str, int]:
    """total, active (what one token uses: 2 of the 8 experts) and active_matmul (active
    without the embedding table and the norms)."""
    attention = HIDDEN * (HEADS + 2 * GROUPS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
    router, expert, norms = EXPERTS * HIDDEN, 3 * HIDDEN * expert_ffn, 2 * HIDDEN
    output, embedding = VOCAB * HIDDEN, VOCAB * HIDDEN
    active_matmul = LAYERS * (attention + router + TOPK * expert) + output
    return {
        "total": LAYERS * (attention + router + EXPERTS * expert + norms)
        + HIDDEN
        + output
        + embedding,
        "active": active_matmul + LAYERS * norms + HIDDEN + embedding,
        "active_matmul": active_matmul,
    }


def _batches(batch: int, seq: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Iteration i's (tokens, labels) [b, s]: counting up from a start drawn for i."""

    def draw(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, VOCAB, (batch, 1), generator=torch.Generator().manual_seed(i))
        tokens = (start + torch.arange(seq + 1)) % VOCAB
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return draw


def _count(step) -> int:
    return sum(p.numel() for p in step.model.parameters())


# Ours: GPTModel, DDP's gradient buffers, the mixed-precision optimizer.


def _ours(seq: int, expert_ffn: int) -> Step:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=expert_ffn,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation="swiglu",
        position_embedding_type="rope", rotary_base=10000, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, num_moe_experts=EXPERTS, moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=TOPK, moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_grouped_gemm=True,
    )  # fmt: skip
    model = GPTModel(config, "local", VOCAB, seq, groups=ModelGroups.single()).train()
    optimizer_config = OptimizerConfig(
        lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, bf16=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    ddp = DistributedDataParallel(optimizer_config, model, dp_group=ONE_RANK)
    optimizer = get_optimizer(optimizer_config, [ddp], mp_group=ONE_RANK)
    positions = torch.arange(seq).unsqueeze(0)

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = ddp(tokens, positions.expand_as(tokens), None, labels=labels).mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        return float(loss.detach())

    step.model = model
    return step


# The baseline: a plain loop over transformers' Mixtral.


def _hf(seq: int, expert_ffn: int) -> Step:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=expert_ffn,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
        output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEFF, router_jitter_noise=0.0,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=seq, sliding_window=None,
        tie_word_embeddings=False, attention_dropout=0.0, initializer_range=0.02,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).to(torch.bfloat16).train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fp32 main parameters and gradients, allocated once (as ours keeps its buffers).
    main = [p.detach().float() for p in params]
    for m in main:
        m.grad = torch.zeros_like(m)
    decayed = [m for m, p in zip(main, params, strict=True) if p.dim() > 1]
    not_decayed = [m for m, p in zip(main, params, strict=True) if p.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": not_decayed, "weight_decay": 0.0},
         {"params": decayed, "weight_decay": WEIGHT_DECAY}], lr=LR,
    )  # fmt: skip

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> float:
        out = model(input_ids=tokens, labels=labels, shift_labels=labels)
        out.loss.backward()
        for m, p in zip(main, params, strict=True):
            m.grad.copy_(p.grad)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(main, CLIP_GRAD)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(main, params, strict=True):
                p.copy_(m)
        # The language-model loss alone, as ours reports it.
        return float(out.loss.detach() - AUX_LOSS_COEFF * out.aux_loss.detach())

    step.model = model
    return step


if __name__ == "__main__":
    main()
