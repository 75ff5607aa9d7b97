"""Benchmark: training-step time of mp_optim's DistributedDataParallel beside torch's.

DP = 2 over gloo: two ranks forked by mp_state.testing.run_on_ranks, one
thread each (the CI machine has two cores). The model is a plain torch stack
of `--layers` pre-norm MLP blocks,

    x + Linear(4h -> h)(GELU(Linear(h -> 4h)(LayerNorm(x))))

with hidden h = 1024 and 6 blocks by default: 50,374,656 parameters, 201 MB
of fp32 gradients. Linear weights ~ N(0, 0.02), biases zero. Activations are
[b, s, h] (batch, sequence, hidden), fp32; the loss is output.square().mean().
Both ranks build the model from the same seed and feed it different data.
Each rank holds two copies: one wrapped in ours, one in
torch.nn.parallel.DistributedDataParallel, both over the same group.

A step is: zero the gradients, forward, backward, gradients averaged over
DP, optimizer step.

    ours:  optimizer.zero_grad() (zeros the gradient buffers) -> forward ->
           backward -> model.finish_grad_sync() -> optimizer.step()
           (get_optimizer: AdamW inside, clip_grad=0)
    torch: optimizer.zero_grad() (sets .grad to None) -> forward -> backward
           (DDP's reducer all-reduces during it) -> torch.optim.AdamW.step()

Both AdamWs have lr 1e-4, weight decay 0.01 on matrices and none on biases
and LayerNorm weights (Megatron's rule, which get_optimizer applies), betas
(0.9, 0.999), eps 1e-8. Clipping is off in ours, but its step still computes
the global gradient norm (one extra pass over the gradients) that torch's
does not. `grad_sync_only` measures leave the optimizer step out.

    ddp_step[overlap]          ours: overlap_grad_reduce, buckets of 6,250,000
                               elements (25 MB); torch: default buckets
                               (bucket_cap_mb=25, the first 1 MiB)
    ddp_step[no_overlap]       ours: one bucket reduced after the backward;
                               torch: one bucket large enough for all gradients
                               (its reduction starts when the last gradient lands)
    grad_sync_only[...]        the same without the optimizer step

Correctness first, on the first step (same data for both): ours' averaged
gradients (.main_grad) and torch's (.grad), then the parameters after the
optimizer step, must agree within 1e-5 relative (|ours - torch's| /
|torch's| in L2, per tensor), or the run stops: otherwise the two would be
doing different work. (The gradients are checked on their own because
AdamW's first update, about lr x sign(gradient), would hide a wrong scale.)
Then each side takes `--warmup` untimed steps, and the sides alternate for
`--steps` timed steps (the order flips every round, so drift hits both
alike), each after a barrier, timed on rank 0. The figures are the fastest
step and the median. ratio_to_torch is ours'
fastest time / torch's fastest time (target: <= 1.05); beside it the ratio
of the medians and the median over rounds of ours' step / torch's step in the
same round, which is the least disturbed by other load on the machine.

The default batch is 2 sequences of 128 (a step of about 1.2 s per rank;
batch 8 would take 3.5 s), so that the whole run takes about 2 minutes on
two cores; the model keeps its size, so the gradients reduced and the
optimizer's work are those of any batch.

    uv run python ci/bench/bench_ddp.py
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics

import torch
from harness import context, emit, take_turns

import mp_state
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state.testing import run_on_ranks

DP = 2
TARGET_RATIO = 1.05
LR, WEIGHT_DECAY = 1e-4, 0.01
OURS_OVERLAP_BUCKET = 6_250_000
"""Elements per bucket with overlap: 25 MB of fp32, torch's default bucket_cap_mb."""
RTOL = 1e-5
"""Largest |ours - torch's| / |torch's| (L2, per tensor) of the correctness check."""
SETTINGS = ("overlap", "no_overlap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size h")
    parser.add_argument("--layers", type=int, default=6, help="MLP blocks")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128, help="sequence length")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the run")
    args = parser.parse_args()
    ctx = context()
    load_before = round(os.getloadavg()[0], 2)
    results = run_on_ranks(_rank, DP, args, timeout=args.timeout)
    # Other processes on the machine show here (the ranks themselves add about 2).
    load = {"load_1min_before": load_before, "load_1min_after": round(os.getloadavg()[0], 2)}
    shape = {
        "dp": DP, "parameters": results[0]["parameters"], "hidden": args.hidden,
        "layers": args.layers, "batch_per_rank": args.batch, "sequence_length": args.seq,
        "warmup_steps": args.warmup, "timed_steps": args.steps, "threads_per_rank": 1,
    }  # fmt: skip
    for setting in SETTINGS:
        measured = results[0][setting]
        for measure, times in measured["times"].items():
            best = {side: min(t) for side, t in times.items()}
            median = {side: statistics.median(t) for side, t in times.items()}
            ratio = best["ours"] / best["torch"]
            paired = [o / t for o, t in zip(times["ours"], times["torch"], strict=True)]
            emit(
                f"{measure}[{setting}]",
                {
                    "step_s": round(best["ours"], 4),
                    "torch_step_s": round(best["torch"], 4),
                    "ratio_to_torch": round(ratio, 3),
                    "ratio_to_torch_median": round(median["ours"] / median["torch"], 3),
                    "ratio_to_torch_paired_median": round(statistics.median(paired), 3),
                    "target_ratio": TARGET_RATIO,
                    "meets_target": ratio <= TARGET_RATIO,
                    "step_s_median": round(median["ours"], 4),
                    "torch_step_s_median": round(median["torch"], 4),
                    "ours_buckets": measured["ours_buckets"],
                    "torch_bucket_cap_mb": measured["torch_bucket_cap_mb"],
                    "first_step_grad_rel_error": measured["grad_rel_error"],
                    "first_step_param_rel_error": measured["param_rel_error"],
                    **shape,
                    **load,
                },
                ctx,
            )


# The model.


class _Block(torch.nn.Module):
    """x + W2 GELU(W1 LayerNorm(x)); x is [b, s, h]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        return x_bsh + self.down(torch.nn.functional.gelu(self.up(self.norm(x_bsh))))


def _model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Block(hidden) for _ in range(layers)))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            torch.nn.init.zeros_(module.bias)
    return model


# One rank.


def _rank(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig())
    rank = state.dp.rank
    generator = torch.Generator().manual_seed(1 + rank)
    x_bsh = torch.randn(args.batch, args.seq, args.hidden, generator=generator)
    result: dict = {}
    for setting in SETTINGS:
        result[setting] = _measure_setting(setting, state, x_bsh, args)
        gc.collect()
    result["parameters"] = result[SETTINGS[0]]["parameters"]
    mp_state.destroy()
    return result


def _measure_setting(
    setting: str, state: mp_state.ParallelState, x_bsh: torch.Tensor, args: argparse.Namespace
) -> dict:
    overlap = setting == "overlap"
    config = OptimizerConfig(
        lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=0.0, overlap_grad_reduce=overlap,
        bucket_size=OURS_OVERLAP_BUCKET if overlap else None,
    )  # fmt: skip
    ours = DistributedDataParallel(config, _model(args.hidden, args.layers), dp_group=state.dp)
    ours_optimizer = get_optimizer(config, [ours], mp_group=state.mp)

    theirs_module = _model(args.hidden, args.layers)
    grad_mb = sum(p.numel() * p.element_size() for p in theirs_module.parameters()) / 2**20
    # None: torch's default (25 MiB, the first bucket 1 MiB); else one bucket for everything.
    bucket_cap_mb = None if overlap else int(grad_mb) + 1
    theirs = torch.nn.parallel.DistributedDataParallel(
        theirs_module, process_group=state.dp.group, bucket_cap_mb=bucket_cap_mb
    )
    params = list(theirs_module.parameters())
    groups = [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0},
    ]
    theirs_optimizer = torch.optim.AdamW(
        groups, lr=LR, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps
    )

    def ours_grads() -> None:
        ours_optimizer.zero_grad()
        ours(x_bsh).square().mean().backward()
        ours.finish_grad_sync()

    def theirs_grads() -> None:
        theirs_optimizer.zero_grad()
        theirs(x_bsh).square().mean().backward()

    def ours_step() -> None:
        ours_grads()
        ours_optimizer.step()

    def theirs_step() -> None:
        theirs_grads()
        theirs_optimizer.step()

    where = f"rank {state.dp.global_rank}, {setting}"
    pairs = list(zip(ours.module.named_parameters(), theirs_module.parameters(), strict=True))
    ours_grads()
    theirs_grads()
    grads = [(name, mine.main_grad, other.grad) for (name, mine), other in pairs]
    grad_error = _check_same(grads, f"{where}, gradients")
    ours_optimizer.step()
    theirs_optimizer.step()
    param_error = _check_same([(n, p, q) for (n, p), q in pairs], f"{where}, parameters")

    measures = {
        "ddp_step": {"ours": ours_step, "torch": theirs_step},
        "grad_sync_only": {"ours": ours_grads, "torch": theirs_grads},
    }
    times = {name: take_turns(sides, args.warmup, args.steps) for name, sides in measures.items()}
    return {
        "times": times,
        "parameters": sum(p.numel() for p in theirs_module.parameters()),
        "grad_rel_error": grad_error,
        "param_rel_error": param_error,
        "ours_buckets": len(ours.buckets),
        "torch_bucket_cap_mb": bucket_cap_mb or 25,
    }


@torch.no_grad()
def _check_same(tensors: list[tuple[str, torch.Tensor, torch.Tensor]], where: str) -> float:
    """The largest |ours - torch's| / |torch's| over (name, ours, torch's); raises above RTOL."""
    largest = 0.0
    for name, mine, other in tensors:
        error = float((mine - other).norm() / other.norm().clamp_min(1e-30))
        if not error <= RTOL:
            raise RuntimeError(
                f"{where}: {name} differs between ours and torch's DDP by {error:.2e} relative "
                f"(allowed {RTOL:.0e}), so the two do not do the same work"
            )
        largest = max(largest, error)
    return largest


if __name__ == "__main__":
    main()
