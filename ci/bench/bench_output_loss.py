"""Benchmark: peak memory and time of the output layer + cross entropy at a 128k vocabulary,
the chunked path (TransformerConfig.output_loss_chunk_tokens) against today's, side by side.

What runs is what GPTModel's last stage runs at TP 1 once it has the final hidden states,
forward and backward, in bf16 (bf16 parameters, as --bf16 trains them):

- unchunked: ColumnParallelLinear(h, v)(hidden) -> [n, 1, v] logits ->
  vocab_parallel_cross_entropy(grad_in_logits=True) (the gradient written over the logits);
- chunked: chunked_linear_cross_entropy(layer.matmul_input(hidden), layer.weight, ...,
  chunk_tokens) with each --chunk.

Each variant runs in a fresh process (the two take turns for --rounds rounds, their order
swapped every round), which builds the layer, the hidden states [n, 1, h] (a leaf that
wants a gradient) and the targets, then runs --iters iterations of forward + backward of
loss.mean(), the gradients reset to None before each. Before each iteration the process's
peak resident set is reset (malloc_trim, /proc/self/clear_refs 5) and its resident set
read; after it the peak (VmHWM) is read. The loss's share of memory is that peak minus
the resident set before the output layer's forward: the logits, their gradient, the work
spaces, and the gradients of the hidden states and of the weight (the weight's gradient,
2 v h bytes, is in both; it is printed beside them). Figures: the median share of each,
their ratio (target <= 0.5), and the best and median seconds of an iteration, the first
iteration of each process left out of the times (unless --iters 1). The losses of the two
paths are printed side by side (the same inputs).

    uv run python ci/bench/bench_output_loss.py [--tokens 4096 8192] [--chunk 1024]
        [--hidden 2048] [--vocab 128256] [--rounds 2] [--iters 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from harness import context, emit, reset_peak_rss, status_mib

TARGET_MEMORY_RATIO = 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--chunk", type=int, nargs="+", default=[1024], help="chunk_tokens")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2, help="iterations per process")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # chunk_tokens, 0: unchunked
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_measure(args.tokens[0], args.hidden, args.vocab, args.child,
                                  args.iters)))  # fmt: skip
        return

    ctx = context()
    for tokens in args.tokens:
        runs: dict[int, list[dict]] = {chunk: [] for chunk in [0, *args.chunk]}
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
            for chunk in order:
                runs[chunk].append(_child(args, tokens, chunk))
        base = _summary(runs[0])
        for chunk in args.chunk:
            ours = _summary(runs[chunk])
            emit(
                "output_loss_memory",
                {
                    "tokens": tokens, "hidden": args.hidden, "vocab": args.vocab,
                    "dtype": "bf16", "chunk_tokens": chunk,
                    "chunked_share_mib": ours["share_mib"],
                    "unchunked_share_mib": base["share_mib"],
                    "share_ratio": round(ours["share_mib"] / base["share_mib"], 3),
                    "target": f"<= {TARGET_MEMORY_RATIO}",
                    "weight_grad_mib": round(2 * args.vocab * args.hidden / 2**20, 1),
                    "chunked_s_best": ours["best_s"], "unchunked_s_best": base["best_s"],
                    "chunked_s_median": ours["median_s"],
                    "unchunked_s_median": base["median_s"],
                    "time_ratio_best": round(ours["best_s"] / base["best_s"], 3),
                    "loss": [ours["loss"], base["loss"]],
                    "shares_mib": [ours["shares"], base["shares"]],
                    "rounds": args.rounds, "iters": args.iters,
                },
                ctx,
            )  # fmt: skip


def _child(args: argparse.Namespace, tokens: int, chunk: int) -> dict:
    command = [sys.executable, __file__, "--child", str(chunk), "--tokens", str(tokens),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--iters", str(args.iters)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    shares = [share for run in runs for share in run["share_mib"]]
    # Each process's first iteration is left out, unless it ran only one.
    seconds = [s for run in runs for s in (run["seconds"][1:] or run["seconds"])]
    return {
        "share_mib": round(statistics.median(shares), 1),
        "shares": [round(s, 1) for s in shares],
        "best_s": round(min(seconds), 3),
        "median_s": round(statistics.median(seconds), 3),
        "loss": runs[0]["loss"],
    }


def _measure(tokens: int, hidden_size: int, vocab: int, chunk: int, iters: int) -> dict:
    """In this fresh process: `iters` forward + backward passes of one variant."""
    import torch

    from mp_layers.tensor_parallel import (
        ColumnParallelLinear,
        chunked_linear_cross_entropy,
        vocab_parallel_cross_entropy,
    )
    from mp_state import RankGroup

    one_rank = RankGroup("tp", (0,), 0, None)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(
        hidden_size, vocab, tp_group=one_rank, bias=False, params_dtype=torch.bfloat16,
        init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
    )  # fmt: skip
    hidden = torch.randn(tokens, 1, hidden_size, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens, 1))
    shares, seconds = [], []
    for _ in range(iters):
        hidden.grad = layer.weight.grad = None
        before = reset_peak_rss()
        start = time.perf_counter()
        if chunk:
            total = layer.matmul_input(hidden)
            loss = chunked_linear_cross_entropy(total, layer.weight, target, one_rank, chunk)
        else:
            logits, _ = layer(hidden)
            loss = vocab_parallel_cross_entropy(logits, target, one_rank, grad_in_logits=True)
            del logits
        mean = loss.mean()
        mean.backward()
        seconds.append(time.perf_counter() - start)
        shares.append(status_mib("VmHWM") - before)
        value = mean.item()
        del loss, mean
    return {"share_mib": shares, "seconds": seconds, "loss": value}


if __name__ == "__main__":
    main()
