"""Measure: what a Mamba layer keeps for backward in training, and its forward + backward
time, with the mixer's recompute (its convolution, scan and gated norm run again in
backward, mp's default) against keeping every tensor (MambaMixer.recompute = False).

One MambaLayer (hidden 256, 16 heads of 32 channels in 2 groups, state 64; RMSNorm, no
biases, dropout 0) on one thread's rank of this CPU, micro-batch 2 x 1,024 tokens, in
fp32 and in bf16. Kept bytes: the storages autograd saves for backward in one forward
(saved-tensor hooks; the layer's parameters and input left out), per token. Time: after
a warm-up call each, the two sides alternate (the order flipped every round) for
`--repeats` rounds; best and median of each.

    uv run python ci/bench/bench_mamba_recompute.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import context, emit


def build(dtype):
    import torch

    from mp_layers import MambaLayer, ModelGroups, TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=4, hybrid_layer_pattern="M",
        mamba_num_heads=16, mamba_head_dim=32, mamba_num_groups=2, mamba_state_dim=64,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = MambaLayer(config, ModelGroups.single()).train()
    x = torch.randn(1024, 2, 256, dtype=dtype, requires_grad=True)
    return layer, x


def kept_bytes_per_token(layer, x) -> float:
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    own.add(x.untyped_storage().data_ptr())
    return sum(n for ptr, n in storages.items() if ptr not in own) / (x.shape[0] * x.shape[1])


def measure_recompute(module, owner, x, repeats: int) -> tuple[dict, dict]:
    """(kept bytes per token, forward + backward times) of `module` on `x` with
    owner.recompute on ("recompute") and off ("keep"): a warm-up call each, then the two
    sides alternating, the order flipped every round, `repeats` rounds."""
    kept, times = {}, {"recompute": [], "keep": []}
    for side in times:
        owner.recompute = side == "recompute"
        kept[side] = kept_bytes_per_token(module, x)
        module(x).sum().backward()  # warm-up
    order = list(times)
    for _ in range(repeats):
        for side in order:
            owner.recompute = side == "recompute"
            start = time.perf_counter()
            module(x).sum().backward()
            times[side].append(time.perf_counter() - start)
        order.reverse()
    return kept, times


def report(measure: str, dtype: str, tokens: int, kept: dict, times: dict, ctx) -> None:
    best = {side: min(t) for side, t in times.items()}
    emit(measure, {
        "dtype": dtype, "tokens": tokens,
        "kept_bytes_per_token": {s: round(v) for s, v in kept.items()},
        "best_ms": {s: round(v * 1e3, 1) for s, v in best.items()},
        "median_ms": {s: round(statistics.median(t) * 1e3, 1) for s, t in times.items()},
        "time_recompute_over_keep": round(best["recompute"] / best["keep"], 2),
        "kept_keep_over_recompute": round(kept["keep"] / kept["recompute"], 1),
    }, ctx)  # fmt: skip


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = context()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        layer, x = build(dtype)
        kept, times = measure_recompute(layer, layer.mixer, x, args.repeats)
        report("mamba_recompute", name, 2048, kept, times, ctx)


if __name__ == "__main__":
    main()
