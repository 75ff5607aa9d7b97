"""A training iteration of mp's GPTModel beside a hand-written loop over a transformers
model, timed in alternating rounds: what bench_moe.py, bench_qwen3_moe.py,
bench_gpt_oss.py and bench_deepseek.py share.

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
coefficient times its load-balancing loss over all layers' router logits where the model
has one; ours is Megatron's, one per layer, summed); the step returns the language-model
loss alone on both sides.

Both sides train on the same tokens: sequences counting up from a random start (token
t + 1 follows token t, modulo the vocabulary), the labels the next tokens (no shift
inside transformers: shift_labels). Both models stay alive side by side: each round
runs ours for warm-up + timed iterations, then the baseline for as many (then any
further side, such as ours with more work, for as many); tokens/s comes from the fastest
timed iteration of each over all rounds, the median beside it (other processes on the
machine lengthen single iterations of either side). MFU is against
the best bf16 n x n matmul measure (mp_train.observability.metrics.measure_peak_tflops) taken before
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from harness import context, emit
from moe_shapes import DeepSeekShape, MoeShape

from mp_ckpt import CheckpointReader, import_hf, load_checkpoint
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import RankGroup
from mp_train.observability.metrics import measure_peak_tflops

__all__ = ["HF_COMMON", "Runs", "Side", "Step", "add_training_arguments", "draw_normal", "hf_step",
           "imported_steps", "mp_step", "parse_arguments", "report", "run_rounds"]  # fmt: skip

LR, WEIGHT_DECAY, CLIP_GRAD = 1e-3, 0.01, 1.0
FIRST_LOSS_TOLERANCE = 5e-2
"""bf16: the most the first losses of two sides starting from the same weights differ."""
DP, EXPERT_DP, MP, EXPERT_MP = (RankGroup(name, (0,), 0, None) for name in
                                ("dp", "expert_dp", "mp", "tp_ep_pp"))  # fmt: skip

HF_COMMON = {"tie_word_embeddings": False, "attention_dropout": 0.0, "initializer_range": 0.02,
             "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # fmt: skip
"""What every baseline's transformers config sets alike: untied embeddings, no dropout,
transformers' initialization at std 0.02, token ids 0."""

Step = Callable[[torch.Tensor, torch.Tensor], float]
"""One training iteration on (tokens, labels) [b, s]; returns the language-model loss.
Its `model` attribute is the model it trains."""


def parse_arguments(doc: str, parser: argparse.ArgumentParser | None = None):
    """The command line (the benchmark's own options in `parser`, the rounds' here); every
    core for torch."""
    parser = parser or argparse.ArgumentParser()
    parser.description = doc.splitlines()[0]
    add_training_arguments(parser)
    torch.set_num_threads(os.cpu_count() or 1)
    return parser.parse_args()


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The rounds' options (run_rounds, report)."""
    parser.add_argument("--seq", type=int, default=2048, help="sequence length")
    parser.add_argument("--batch", type=int, default=1, help="sequences per iteration")
    parser.add_argument("--rounds", type=int, default=4, help="turns of ours, then baseline")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per turn")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per turn")
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the n x n matmul peak")


# Ours: GPTModel, DDP's gradient buffers, the mixed-precision optimizer.


def mp_step(config: TransformerConfig, vocab: int, seq: int, weights: Path | None = None,
            fresh: tuple[str, ...] = ()) -> Step:  # fmt: skip
    """GPTModel of `config` (its own seeded initialization, or the checkpoint `weights`;
    the tensors whose logical names start with a `fresh` prefix, which the checkpoint does
    not hold, keep the initialization)."""
    torch.manual_seed(0)
    model = GPTModel(config, "local", vocab, seq, groups=ModelGroups.single()).train()
    if weights is not None:
        pieces = {k: p for k, p in model.sharded_state_dict().items()
                  if not (fresh and p.key.startswith(fresh))}  # fmt: skip
        load_checkpoint(weights, pieces)
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


def imported_steps(hf_model, seq: int, variants: dict[str, dict[str, Any]] | None = None,
                   fresh: tuple[str, ...] = ()) -> dict[str, Step]:  # fmt: skip
    """Both sides from the same weights: `hf_model` (fp32, transformers' initialization)
    saved and imported by mp_ckpt.import_hf; ours the GPTModel of the imported settings
    alone (as tests/test_hf_families.py builds it) with bf16 parameters and grouped expert
    matmuls, loaded from that checkpoint; the baseline `hf_model` cast to bf16. Both first
    iterations see the same weights and tokens: report(same_weights=True) checks that
    their losses agree within FIRST_LOSS_TOLERANCE.

    variants: further sides of ours by name, each the settings it changes (such as
    mtp_num_layers), loaded from the same checkpoint but for the `fresh` prefixes (the
    modules the transformers model has no weights for)."""
    with tempfile.TemporaryDirectory() as folder:
        hf_model.save_pretrained(Path(folder) / "hf")
        checkpoint = import_hf(Path(folder) / "hf", Path(folder) / "mp")
        common = torch.load(CheckpointReader(checkpoint).directory / "common.pt",
                            weights_only=False)  # fmt: skip
        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        settings = {k: v for k, v in common["model_config"].items() if k in names}
        settings |= {"params_dtype": torch.bfloat16, "moe_grouped_gemm": True}
        vocab, weights = hf_model.config.vocab_size, Path(folder) / "mp"
        steps = {"ours": mp_step(TransformerConfig(**settings), vocab, seq, weights)}
        for name, changes in (variants or {}).items():
            config = TransformerConfig(**settings | changes)
            steps[name] = mp_step(config, vocab, seq, weights, fresh)
    return {"ours": steps.pop("ours"), "hf": hf_step(hf_model), **steps}


def draw_normal(named: Iterable[tuple[str, torch.Tensor]], suffix: str, std: float) -> None:
    """Draws normal(0, std) into the tensors of `named` whose names end with `suffix`:
    values for what transformers starts at 0 (biases), so that the first-loss check of
    imported_steps covers them."""
    with torch.no_grad():
        for name, tensor in named:
            if name.endswith(suffix):
                tensor.normal_(std=std)


# The baseline: a plain loop over a transformers model.


def hf_step(model) -> Step:
    """The loop over `model` (a transformers CausalLM, cast to bf16 here): with
    output_router_logits its loss holds router_aux_loss_coef times its load-balancing loss,
    which the step leaves out of the loss it returns; a model without one (DeepSeek-V3 in
    transformers balances by its routers' correction bias alone) returns its loss as is."""
    aux_loss_coeff = getattr(model.config, "router_aux_loss_coef", 0.0)
    model = _to_bf16(model).train()
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
        aux_loss = getattr(out, "aux_loss", None)
        if aux_loss is None:
            return float(out.loss.detach())
        return float(out.loss.detach() - aux_loss_coeff * aux_loss.detach())

    step.model = model
    return step


def _to_bf16(model):
    """`model` cast to bf16 but for the tensors transformers keeps in fp32 whatever the
    dtype it loads with (_keep_in_fp32_modules_strict: DeepSeek-V3's router correction
    bias), as from_pretrained(dtype=torch.bfloat16) gives them."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    kept = {n: t.detach().clone() for n, t in model.state_dict().items()
            if any(k in n.split(".") for k in keep)}  # fmt: skip
    model = model.to(torch.bfloat16)
    for name, value in kept.items():
        module_name, _, attribute = name.rpartition(".")
        tensor = getattr(model.get_submodule(module_name), attribute)
        tensor.data = value
    return model


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


@dataclass(frozen=True)
class Side:
    """A step report runs beside "ours" and "hf" (ours with more work, e.g. multi-token
    prediction), which its figures do not compare to the target."""

    parameters: int
    """What its model must hold."""
    flops_per_token: float
    """Forward and backward, what its MFU counts."""


def report(measure: str, shape: MoeShape | DeepSeekShape, steps: dict[str, Step],
           args: argparse.Namespace, attention: float, target: float,
           same_weights: bool = False, sides: dict[str, Side] | None = None,
           **extra: Any) -> Runs:  # fmt: skip
    """Checks that both models count shape's parameters, runs the rounds and prints the
    matmul peak and `measure` (figures, extra, shape, settings) as JSON lines.
    attention: attention_flops summed over the layers. same_weights: both sides start from
    the same weights (imported_steps), so their first losses differ by at most
    FIRST_LOSS_TOLERANCE (raises after printing otherwise). sides: the further steps of
    `steps` by name, each checked to hold its parameters, its figures under its name
    (first losses against ours')."""
    sides = sides or {}
    counts = shape.counts()
    expected = {"ours": counts["total"], "hf": counts["total"]}
    expected |= {name: side.parameters for name, side in sides.items()}
    params = {k: sum(p.numel() for p in step.model.parameters()) for k, step in steps.items()}
    if params != expected:
        raise RuntimeError(f"parameters {params}, expected {expected}")
    print(f"parameters: {counts['active']:,} active of {counts['total']:,}", flush=True)
    ctx = context()
    tokens = args.batch * args.seq
    flops = tokens * (6 * counts["active_matmul"] + attention)
    runs = run_rounds(steps, args, shape.vocab)
    emit("matmul_peak[bf16]", {"tflops": round(runs.peak / 1e12, 4), "n": args.peak_n}, ctx)
    hf_config = steps["hf"].model.config  # what transformers chose by default
    first = {name: abs(runs.losses[name][0] - runs.losses["hf" if name == "ours" else "ours"][0])
             for name in ("ours", *sides)}  # fmt: skip
    figures = _figures(runs, tokens, flops, target) | extra | {
        "first_loss_difference": round(first["ours"], 4),
        "active_parameters": counts["active"], "parameters": params["ours"],
        "hf_parameters": params["hf"],
        "hf_experts_implementation": hf_config._experts_implementation,
        "hf_attn_implementation": hf_config._attn_implementation,
    }  # fmt: skip
    for name, side in sides.items():
        figures |= _side_figures(runs, name, f"{name}_", tokens, tokens * side.flops_per_token)
        figures |= _ratios(runs, name, f"{name}_") | {
            f"{name}_first_loss_difference_to_ours": round(first[name], 4),
            f"{name}_parameters": params[name],
        }
    settings = {
        "sequence_length": args.seq, "batch": args.batch, "rounds": args.rounds,
        "warmup_per_turn": args.warmup, "timed_per_turn": args.iters,
        "precision": "bf16 parameters, fp32 gradients and main parameters (both)",
    }  # fmt: skip
    emit(measure, figures | dataclasses.asdict(shape) | settings, ctx)
    if same_weights and max(first.values()) > FIRST_LOSS_TOLERANCE:
        firsts = {name: round(losses[0], 4) for name, losses in runs.losses.items()}
        raise RuntimeError(
            f"first losses {firsts} differ by more than {FIRST_LOSS_TOLERANCE} from the same "
            "weights"
        )
    return runs


def _figures(runs: Runs, tokens: int, flops: float, target: float) -> dict[str, Any]:
    """The JSON figures of ours against "hf": tokens/s (best, median), ratios, MFU, losses."""
    ratio = min(runs.times["hf"]) / min(runs.times["ours"])
    return (
        _side_figures(runs, "ours", "", tokens, flops)
        | _side_figures(runs, "hf", "hf_", tokens, flops)
        | _ratios(runs, "ours", "")
        | {
            "target_ratio": target,
            "meets_target": ratio >= target,
            "matmul_peak_tflops": round(runs.peak / 1e12, 4),
            "flops_per_iteration": int(flops),
        }
    )


def _ratios(runs: Runs, name: str, prefix: str) -> dict[str, float]:
    """The baseline's iteration time over `name`'s, best and median."""
    times, hf = runs.times[name], runs.times["hf"]
    return {
        prefix + "ratio_to_hf": round(min(hf) / min(times), 3),
        prefix + "ratio_to_hf_median": round(statistics.median(hf) / statistics.median(times), 3),
    }


def _side_figures(runs: Runs, name: str, prefix: str, tokens: int, flops: float) -> dict[str, Any]:
    """One side's figures, their names prefixed: tokens/s (best, median), iteration times,
    MFU, achieved TFLOP/s, losses."""
    best, median = min(runs.times[name]), statistics.median(runs.times[name])
    figures = {
        "tokens_per_s": round(tokens / best, 1),
        "tokens_per_s_median": round(tokens / median, 1),
        "iteration_s": [round(t, 3) for t in runs.times[name]],
        "mfu": round(flops / best / runs.peak, 3),
        "achieved_tflops": round(flops / best / 1e12, 4),
        "losses": [round(x, 3) for x in runs.losses[name]],
    }
    return {prefix + k: v for k, v in figures.items()}


def _batch(i: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Iteration i's (tokens, labels) [b, s]: counting up from a start drawn for i."""
    start = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(i))
    tokens = (start + torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
