"""Benchmark: per-new-token time and KV-cache bytes of greedy decoding through an
mp_layers.KVCache for a model with gpt-oss's attention, whose windowed layers keep a ring
of their window's latest keys.

One process, all cores (torch.set_num_threads(os.cpu_count()); --threads 1 is steadier
on a machine other processes share). The model: the
Llama-style shape of bench_generate.py (harness.LLAMA_SHAPE: hidden 512, 8 layers, 8
heads in 4 query groups of 64 channels, SwiGLU ffn 1376, RMSNorm, untied embeddings,
vocabulary 32,000) with gpt-oss's attention: a learnable sink per head, a sliding window
of 128 keys (window_size=(127, 0)) on alternate layers from the first, q/k/v biases,
YaRN rotary; random weights (init_seed 0), no baseline model: compare commits by running
this script on each, in turns.

The work: b prompts of --prompt-len random token ids, a prefill, then --new-tokens - 1
greedy decode steps (GPTModel forward of the batch's next ids over the cache, argmax),
each step timed alone. A round's figure is its median step (robust to a busy machine);
the best and the median over --rounds rounds after one untimed warm-up round.
`cache_bytes`: what one KVCache of the whole generation holds per windowed and per full
layer after the prompts and one step, measured (KVCache.layer_bytes); a full layer's
bytes per position and sequence; the positions a windowed layer holds.

    uv run python ci/bench/bench_generate_window.py [--batch-sizes 1 8 --new-tokens 512
        --prompt-len 128 --rounds 3 --dtypes bf16 --threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness import LLAMA_SHAPE, context, emit

from mp_layers import GPTModel, KVCache, ModelGroups, TransformerConfig

HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = LLAMA_SHAPE
WINDOW = 127
"""Earlier keys a windowed layer's query sees (gpt-oss's sliding_window 128, itself included)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: every core)")  # fmt: skip
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2: decode time is the calls' difference")
    torch.set_num_threads(args.threads)
    ctx = context()
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        normalization="RMSNorm", activation="swiglu", position_embedding_type="yarn",
        rotary_base=150000, yarn_rotary_scaling_factor=32.0,
        yarn_original_max_position_embeddings=4096, add_bias_linear=False, add_qkv_bias=True,
        softmax_type="learnable", window_size=(WINDOW, 0), window_attn_skip_freq=2,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    length = args.prompt_len + args.new_tokens
    model = GPTModel(config, "local", VOCAB, length, groups=ModelGroups.single(),
                     parallel_output=False, init_seed=0).eval()  # fmt: skip
    for name in args.dtypes:
        model.to(DTYPES[name])
        for b in args.batch_sizes:
            prompts = torch.randint(0, VOCAB, (b, args.prompt_len),
                                    generator=torch.Generator().manual_seed(b))  # fmt: skip
            figures = _time(model, prompts, args)
            figures["cache_bytes"] = _cache_bytes(model, prompts, length)
            emit(f"generate_window_per_token[{name},b{b}]", figures, ctx)


def _time(model: GPTModel, prompts: torch.Tensor, args) -> dict:
    """Rounds of the prompts' prefill then new-tokens - 1 greedy decode steps, each timed."""
    length = args.prompt_len + args.new_tokens
    step_medians = []
    for round_ in range(args.rounds + 1):  # the first is a warm-up
        cache = KVCache(torch.zeros(prompts.shape[0], dtype=torch.long), length)
        steps = []
        with torch.no_grad():
            next_ids = model(prompts, kv_cache=cache)[:, -1].argmax(-1)
            for _ in range(args.new_tokens - 1):
                start = time.perf_counter()
                next_ids = model(next_ids[:, None], kv_cache=cache)[:, -1].argmax(-1)
                steps.append(time.perf_counter() - start)
        if round_ > 0:
            step_medians.append(statistics.median(steps))
    return {
        "ms_per_token": round(min(step_medians) * 1e3, 3),
        "ms_per_token_median": round(statistics.median(step_medians) * 1e3, 3),
        "shape": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "query_groups": GROUPS,
                  "ffn": FFN, "vocab": VOCAB, "window": WINDOW + 1,
                  "batch": prompts.shape[0], "prompt_len": args.prompt_len,
                  "new_tokens": args.new_tokens, "rounds": args.rounds},
    }  # fmt: skip


def _cache_bytes(model: GPTModel, prompts: torch.Tensor, max_length: int) -> dict:
    cache = KVCache(torch.zeros(prompts.shape[0], dtype=torch.long), max_length)
    with torch.no_grad():
        model(prompts, kv_cache=cache)
        model(prompts[:, -1:], kv_cache=cache)
    held = [cache.layer_bytes(layer) for layer in range(LAYERS)]
    windowed, full = held[0], held[1]  # layers 0, 2, ... are windowed
    per_token = full // (prompts.shape[0] * max_length)  # keys and values of one position
    return {
        "max_length": max_length,
        "windowed_layer": windowed,
        "full_layer": full,
        "per_token_and_layer": per_token,
        "windowed_layer_slots": windowed // (prompts.shape[0] * per_token),
    }


if __name__ == "__main__":
    main()
