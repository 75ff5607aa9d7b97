"""A training iteration of mp's GPTModel beside a hand-written loop over a transformers
model, timed in alternating rounds: what bench_moe.py, bench_qwen3_moe.py and
bench_gpt_oss.py share.

Ours: GPTModel with bf16 parameters, in mp_optim's DistributedDataParallel (fp32
gradient buffers), stepped by its MixedPrecisionOptimizer (fp32 main parameters, AdamW,
global-norm clipping): Megatron's bf16 mixed precision. An iteration: zero the gradient
buffers, forward with labels -> mean per-token loss -> backward (the routers'
auxiliary losses add their gradients in it) -> finish_grad_sync -> optimizer step.

The baseline: the loop one writes by hand over a transformers model with the same
precision treatment: bf16 parameters (no autocast), their gradients copied into fp32
main parameters stepped by torch.optim.AdamW (its default implementation; the same
settings and parameter groups: no weight decay on 1-D parameters), global-norm clipping,
the updated values copied back. Its loss is transformers' own (cross entropy plus the
coefficient times its load-balancing loss over all layers' router logits; ours is
Megatron's, one per layer, summed); the step returns the language-model loss alone on
both sides.

Both sides train on the same tokens: sequences counting up from a random start (token
t + 1 follows token t, modulo the vocabulary), the labels the next tokens (no shift
inside transformers: shift_labels). Both models stay alive side by side: each round
runs ours for warm-up + timed iterations, then the baseline for as many; tokens/s comes
from the fastest timed iteration of each over all rounds, the median beside it (other
processes on the machine lengthen single iterations of either side). MFU is against
the best bf16 n x n matmul measure (mp_train.metrics.measure_peak_tflops) taken before
the runs, before each round and after the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from harness import context, emit

from mp_ckpt import CheckpointReader, import_hf, load_checkpoint
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import RankGroup
from mp_train.metrics import measure_peak_tflops

__all__ = ["MoeShape", "Runs", "Step", "attention_flops", "hf_step",
           "imported_steps", "mp_step", "parse_arguments", "report", "run_rounds"]  # fmt: skip

LR, WEIGHT_DECAY, CLIP_GRAD = 1e-3, 0.01, 1.0
FIRST_LOSS_TOLERANCE = 5e-2
"""bf16: the most the first losses of two sides starting from the same weights differ."""
DP, EXPERT_DP, MP, EXPERT_MP = (RankGroup(name, (0,), 0, None) for name in
                                ("dp", "expert_dp", "mp", "tp_ep_pp"))  # fmt: skip

Step = Callable[[torch.Tensor, torch.Tensor], float]
"""One training iteration on (tokens, labels) [b, s]; returns the language-model loss.
Its `model` attribute is the model it trains."""


def parse_arguments(doc: str, parser: argparse.ArgumentParser | None = None):
    """The command line (the benchmark's own options in `parser`, the rounds' here); every
    core for torch."""
    parser = parser or argparse.ArgumentParser()
    parser.description = doc.splitlines()[0]
    parser.add_argument("--seq", type=int, default=2048, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per iteration")
    parser.add_argument("--rounds", type=int, default=4, help="turns of ours, then baseline")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per turn")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per turn")
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the n x n matmul peak")
    torch.set_num_threads(os.cpu_count() or 1)
    return parser.parse_args()


@dataclass(frozen=True)
class MoeShape:
    """A MoE model of untied embeddings whose every MLP is a mixture of gated experts."""

    hidden: int
    layers: int
    heads: int
    query_groups: int
    head_dim: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int
    qk_norm: bool = False
    """RMSNorm of the queries and keys per head (Qwen3)."""
    biases: bool = False
    """Biases in q, k, v, o, the router and the experts, and one sink per head (gpt-oss)."""

    def counts(self) -> dict[str, int]:
        """total, active (what one token uses: topk of the experts) and active_matmul (the
        active matmul weights: not the embedding table, the norms, the biases)."""
        h, d, nq, ng = self.hidden, self.head_dim, self.heads, self.query_groups
        attention = h * (nq + 2 * ng) * d + nq * d * h
        router, expert = self.experts * h, 3 * h * self.expert_ffn
        small = 2 * h + (2 * d if self.qk_norm else 0)  # per layer: norms, biases, sinks
        expert_biases = 0
        if self.biases:
            small += (nq + 2 * ng) * d + h + nq + self.experts
            expert_biases = 2 * self.expert_ffn + h
        output, embedding = self.vocab * h, self.vocab * h
        active_matmul = self.layers * (attention + router + self.topk * expert) + output
        experts = self.experts * (expert + expert_biases)
        return {
            "total": self.layers * (attention + router + experts + small) + h + output + embedding,
            "active": active_matmul
            + self.layers * (small + self.topk * expert_biases)
            + h
            + embedding,
            "active_matmul": active_matmul,
        }


def attention_flops(seq: int, heads: int, head_dim: int, window: int | None = None) -> float:
    """Per token and layer, forward and backward: the scores and the weighted sum over the
    keys a query attends to (12 nq d per key; s / 2 keys on average when causal, 6 s nq d),
    or over a sliding window of `window` keys before it and itself."""
    keys = seq / 2 if window is None else sum(min(i, window) + 1 for i in range(seq)) / seq
    return 12 * heads * head_dim * keys


# Ours: GPTModel, DDP's gradient buffers, the mixed-precision optimizer.


def mp_step(config: TransformerConfig, vocab: int, seq: int, weights: Path | None = None) -> Step:
    """GPTModel of `config` (its own seeded initialization, or the checkpoint `weights`)."""
    torch.manual_seed(0)
    model = GPTModel(config, "local", vocab, seq, groups=ModelGroups.single()).train()
    if weights is not None:
        load_checkpoint(weights, model.sharded_state_dict())
    optimizer_config = OptimizerConfig(
        lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, bf16=True,
        params_dtype=config.params_dtype,
    )  # fmt: skip
    ddp = DistributedDataParallel(optimizer_config, model, dp_group=DP, expert_dp_group=EXPERT_DP)
    optimizer = get_optimizer(optimizer_config, [ddp], mp_group=MP, expert_mp_group=EXPERT_MP)
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


def imported_steps(hf_model, seq: int) -> dict[str, Step]:
    """Both sides from the same weights: `hf_model` (fp32, transformers' initialization)
    saved and imported by mp_ckpt.import_hf; ours the GPTModel of the imported settings
    alone (as tests/test_hf_families.py builds it) with bf16 parameters and grouped expert
    matmuls, loaded from that checkpoint; the baseline `hf_model` cast to bf16. Both first
    iterations see the same weights and tokens: report(same_weights=True) checks that
    their losses agree within FIRST_LOSS_TOLERANCE."""
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(Path(folder) / "hf")
        checkpoint = import_hf(Path(folder) / "hf", Path(folder) / "mp")
        common = torch.load(CheckpointReader(checkpoint).directory / "common.pt",
                            weights_only=False)  # fmt: skip
        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        settings = {k: v for k, v in common["model_config"].items() if k in names}
        config = TransformerConfig(
            **settings | {"params_dtype": torch.bfloat16, "moe_grouped_gemm": True}
        )
        ours = mp_step(config, hf_model.config.vocab_size, seq, Path(folder) / "mp")
    return {"ours": ours, "hf": hf_step(hf_model)}


# The baseline: a plain loop over a transformers model.


def hf_step(model) -> Step:
    """The loop over `model` (a transformers CausalLM with output_router_logits, cast to
    bf16 here)."""
    aux_loss_coeff = model.config.router_aux_loss_coef
    model = model.to(torch.bfloat16).train()
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
        return float(out.loss.detach() - aux_loss_coeff * out.aux_loss.detach())

    step.model = model
    return step


# The rounds and the figures.


@dataclass
class Runs:
    """Timed seconds and every iteration's loss, per side; the best matmul peak (FLOP/s)."""

    peak: float
    times: dict[str, list[float]] = field(default_factory=dict)
    losses: dict[str, list[float]] = field(default_factory=dict)


def run_rounds(steps: dict[str, Step], args: argparse.Namespace, vocab: int) -> Runs:
    """args.rounds rounds; in each, every step in turn runs args.warmup untimed and
    args.iters timed iterations. Iteration i of a side trains on batch i."""
    runs = Runs(measure_peak_tflops(args.peak_n) * 1e12)
    runs.times, runs.losses = {k: [] for k in steps}, {k: [] for k in steps}
    per_turn = args.warmup + args.iters
    for round_ in range(args.rounds):
        runs.peak = max(runs.peak, measure_peak_tflops(args.peak_n) * 1e12)
        for name, step in steps.items():
            for i in range(per_turn):
                tokens, labels = _batch(round_ * per_turn + i, args.batch, args.seq, vocab)
                start = time.perf_counter()
                runs.losses[name].append(step(tokens, labels))
                if i >= args.warmup:
                    runs.times[name].append(time.perf_counter() - start)
            print(f"round {round_} {name}: {[round(t, 2) for t in runs.times[name][-args.iters:]]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    # Measured before each round and at the end: the best is the machine's (another
    # process running during a measure lowers it).
    runs.peak = max(runs.peak, measure_peak_tflops(args.peak_n) * 1e12)
    return runs


def report(measure: str, shape: MoeShape, steps: dict[str, Step], args: argparse.Namespace,
           attention: float, target: float, same_weights: bool = False,
           **extra: Any) -> Runs:  # fmt: skip
    """Checks that both models count shape's parameters, runs the rounds and prints the
    matmul peak and `measure` (figures, extra, shape, settings) as JSON lines.
    attention: attention_flops summed over the layers. same_weights: both sides start from
    the same weights (imported_steps), so their first losses differ by at most
    FIRST_LOSS_TOLERANCE (raises after printing otherwise)."""
    counts = shape.counts()
    params = {k: sum(p.numel() for p in step.model.parameters()) for k, step in steps.items()}
    if params["ours"] != counts["total"] or params["hf"] != counts["total"]:
        raise RuntimeError(f"parameters {params}, expected {counts['total']} on both sides")
    print(f"parameters: {counts['active']:,} active of {counts['total']:,}", flush=True)
    ctx = context()
    tokens = args.batch * args.seq
    flops = tokens * (6 * counts["active_matmul"] + attention)
    runs = run_rounds(steps, args, shape.vocab)
    emit("matmul_peak[bf16]", {"tflops": round(runs.peak / 1e12, 4), "n": args.peak_n}, ctx)
    hf_config = steps["hf"].model.config  # what transformers chose by default
    first = abs(runs.losses["ours"][0] - runs.losses["hf"][0])
    figures = _figures(runs, tokens, flops, target) | extra | {
        "first_loss_difference": round(first, 4),
        "active_parameters": counts["active"], "parameters": params["ours"],
        "hf_parameters": params["hf"],
        "hf_experts_implementation": hf_config._experts_implementation,
        "hf_attn_implementation": hf_config._attn_implementation,
    }  # fmt: skip
    settings = {
        "sequence_length": args.seq, "batch": args.batch, "rounds": args.rounds,
        "warmup_per_turn": args.warmup, "timed_per_turn": args.iters,
        "precision": "bf16 parameters, fp32 gradients and main parameters (both)",
    }  # fmt: skip
    emit(measure, figures | dataclasses.asdict(shape) | settings, ctx)
    if same_weights and first > FIRST_LOSS_TOLERANCE:
        raise RuntimeError(
            f"first losses {runs.losses['ours'][0]:.4f} (ours) and {runs.losses['hf'][0]:.4f} "
            f"(transformers) differ by more than {FIRST_LOSS_TOLERANCE} from the same weights"
        )
    return runs


def _figures(runs: Runs, tokens: int, flops: float, target: float) -> dict[str, Any]:
    """The JSON figures of ours against "hf": tokens/s (best, median), ratios, MFU, losses."""
    best = {k: min(v) for k, v in runs.times.items()}
    median = {k: statistics.median(v) for k, v in runs.times.items()}
    ratio = best["hf"] / best["ours"]
    return {
        "tokens_per_s": round(tokens / best["ours"], 1),
        "hf_tokens_per_s": round(tokens / best["hf"], 1),
        "tokens_per_s_median": round(tokens / median["ours"], 1),
        "hf_tokens_per_s_median": round(tokens / median["hf"], 1),
        "ratio_to_hf": round(ratio, 3),
        "ratio_to_hf_median": round(median["hf"] / median["ours"], 3),
        "target_ratio": target,
        "meets_target": ratio >= target,
        "iteration_s": [round(t, 3) for t in runs.times["ours"]],
        "hf_iteration_s": [round(t, 3) for t in runs.times["hf"]],
        "mfu": round(flops / best["ours"] / runs.peak, 3),
        "hf_mfu": round(flops / best["hf"] / runs.peak, 3),
        "achieved_tflops": round(flops / best["ours"] / 1e12, 4),
        "hf_achieved_tflops": round(flops / best["hf"] / 1e12, 4),
        "matmul_peak_tflops": round(runs.peak / 1e12, 4),
        "flops_per_iteration": int(flops),
        "losses": [round(x, 3) for x in runs.losses["ours"]],
        "hf_losses": [round(x, 3) for x in runs.losses["hf"]],
    }


def _batch(i: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration i's (tokens, labels) [b, s]: counting up from a start drawn for i."""
    start = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(i))
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
