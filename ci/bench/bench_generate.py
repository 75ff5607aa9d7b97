"""Benchmark: per-new-token time of mp's generation (mp_gpt.generation.generate_batch, KV
cache) beside transformers' `generate` on the same model and the same prompts.

One process, all cores (torch.set_num_threads(os.cpu_count())). The model is the
Llama-style shape of bench_layers.py and bench_gpt.py (harness.LLAMA_SHAPE): hidden
512, 8 layers, 8 heads in 4 query groups of 64 channels, ffn 1376 (SwiGLU), RMSNorm,
RoPE, no biases, untied embeddings, vocabulary 32,000; about 56M parameters, random
weights (transformers' initialization, seed 0, no downloads). The transformers model
is built, saved with save_pretrained and imported by `mp-ckpt import-hf`; ours is
that checkpoint loaded by mp_gpt.generate.Generator (one-rank world), so both hold the
same weights. Both run in the same dtype (--dtypes: bf16 and fp32 by default; the
models are cast after loading).

The work: b prompts of --prompt-len random token ids (no padding on either side),
greedy, exactly --new-tokens new tokens on both sides (transformers:
min_new_tokens = max_new_tokens, eos_token_id=None; ours: eod=None), each side with
its own defaults otherwise (transformers' dynamic cache).

What is timed, per side and round: a prefill call (max_new_tokens=1: the prompts
through the model and the first token drawn) and a full call (--new-tokens). Prefill
tokens/s = b * prompt length / the prefill call's time; per-new-token time = (full
call - prefill call of the same round) / (new tokens - 1), i.e. one decode step of the
whole batch from the KV cache, sampling included. The two sides take turns (ours,
then transformers, for each batch size and dtype) for --rounds rounds after one
untimed warm-up call each; the best and the median over rounds are reported, with the
ratio ours / transformers (target: <= 1.0, lower is faster). `same_tokens` counts how
many leading new tokens of the first sequence agree between the two sides (greedy
over near-uniform logits of random weights: bf16 rounding may change an argmax).

    uv run python ci/bench/bench_generate.py [--batch-sizes 1 8 --new-tokens 512
        --prompt-len 128 --rounds 3 --dtypes bf16 fp32]
    uv run python ci/bench/bench_generate.py --quick   # smoke: 32 new tokens, 1 round

gpu_suite.py runs the same comparison (model_pair, compare) on a GPU with another shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from harness import LLAMA_SHAPE, LlamaShape, context, emit

from mp_ckpt.cli import main as mp_ckpt_main
from mp_gpt.generate import Generator
from mp_gpt.generation import Sampling, generate_batch

SHAPE = LlamaShape(*LLAMA_SHAPE)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET_RATIO = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_generation_arguments(parser)
    args = settle_generation_arguments(parser, parser.parse_args())
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as scratch:
        ours, hf_model = model_pair(SHAPE, args.prompt_len + args.new_tokens, Path(scratch))
    run_comparisons("generate_per_token", ours, hf_model, args, SHAPE)


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The comparison's options (compare, run_comparisons)."""
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="timed turns of each side")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 32 new tokens, 1 round, batch 1 and 8, bf16")  # fmt: skip


def settle_generation_arguments(parser: argparse.ArgumentParser,
                                args: argparse.Namespace) -> argparse.Namespace:  # fmt: skip
    """args with --quick applied; exits through `parser` on too few new tokens."""
    if args.quick:
        args.new_tokens, args.rounds, args.dtypes = 32, 1, ["bf16"]
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2: decode time is the calls' difference")
    return args


def run_comparisons(measure: str, ours: Generator, hf_model, args, shape) -> None:
    """compare in each of args.dtypes (both models cast to it) at each of args.batch_sizes,
    printed as `measure`[dtype,b<b>]; closes `ours`."""
    ctx = context()
    try:
        for name in args.dtypes:
            dtype = DTYPES[name]
            ours.model.to(dtype)
            hf_model.to(dtype)
            for b in args.batch_sizes:
                figures = compare(ours.model, hf_model, b, args, shape)
                emit(f"{measure}[{name},b{b}]", figures, ctx)
    finally:
        ours.close()


def model_pair(shape: LlamaShape, max_positions: int, scratch: Path,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):  # fmt: skip
    """(ours, transformers'): a LlamaForCausalLM of `shape` (transformers' initialization,
    seed 0, built on `device` in `dtype`) and imported_generator of it under `scratch`. Both
    in eval mode."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        hf_model = transformers.LlamaForCausalLM(shape.hf_config(shape.vocab, max_positions))
    hf_model = hf_model.to(dtype).eval()
    return imported_generator(hf_model, scratch), hf_model


def imported_generator(hf_model, scratch: Path, extra: Sequence[str] = ()) -> Generator:
    """mp_gpt.generate's Generator (a one-rank world on mp_state's device, eval mode) over
    `hf_model` saved under `scratch` and imported by `mp-ckpt import-hf`: the same
    weights; extra: the Generator's options beside the checkpoint's settings."""
    hf_model.save_pretrained(scratch / "hf")
    if mp_ckpt_main(["import-hf", str(scratch / "hf"), str(scratch / "ckpt")]) != 0:
        raise RuntimeError("mp-ckpt import-hf failed")
    return Generator(str(scratch / "ckpt"), extra)


def compare(model, hf_model, b: int, args, shape) -> dict:
    """Both sides' figures for b prompts of args.prompt_len random ids (see the module
    docstring); args: new_tokens, prompt_len, rounds; shape: a dataclass with the
    vocabulary as `vocab` (LlamaShape, DeepSeekShape), reported whole."""
    seeded = torch.Generator().manual_seed(b)
    prompts = torch.randint(0, shape.vocab, (b, args.prompt_len), generator=seeded)
    sides = {"ours": _ours(model, prompts, shape.vocab), "hf": _hf(hf_model, prompts)}
    tokens = {side: run(args.new_tokens)[1] for side, run in sides.items()}  # warm-up
    same = 0
    for a, c in zip(tokens["ours"][0], tokens["hf"][0], strict=True):
        if a != c:
            break
        same += 1
    prefill: dict[str, list[float]] = {"ours": [], "hf": []}
    per_token: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(args.rounds):
        for side, run in sides.items():
            first, _ = run(1)
            full, new = run(args.new_tokens)
            if any(len(t) != args.new_tokens for t in new):
                raise RuntimeError(f"{side} generated {[len(t) for t in new]} tokens")
            prefill[side].append(first)
            per_token[side].append((full - first) / (args.new_tokens - 1))
    best = {side: min(v) * 1e3 for side, v in per_token.items()}
    median = {side: statistics.median(v) * 1e3 for side, v in per_token.items()}
    prompt_tokens = b * args.prompt_len
    settings = dataclasses.asdict(shape) | {
        "batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "greedy": True,
    }  # fmt: skip
    return {
        "ms_per_token": round(best["ours"], 3),
        "ms_per_token_median": round(median["ours"], 3),
        "hf_ms_per_token": round(best["hf"], 3),
        "hf_ms_per_token_median": round(median["hf"], 3),
        "ratio_to_hf": round(best["ours"] / best["hf"], 3),
        "ratio_to_hf_median": round(median["ours"] / median["hf"], 3),
        "target_ratio": TARGET_RATIO,
        "prefill_tokens_per_s": round(prompt_tokens / min(prefill["ours"]), 1),
        "hf_prefill_tokens_per_s": round(prompt_tokens / min(prefill["hf"]), 1),
        "prefill_tokens_per_s_median": round(prompt_tokens / statistics.median(prefill["ours"]), 1),
        "hf_prefill_tokens_per_s_median": round(
            prompt_tokens / statistics.median(prefill["hf"]), 1
        ),
        "same_tokens": same,
        "shape": settings,
    }


def _ours(model, prompts: torch.Tensor, vocab: int):
    """A call of generate_batch: (seconds, the new tokens per sequence)."""
    ids = prompts.tolist()

    def run(new_tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        done = generate_batch(model, ids, max_new_tokens=new_tokens,
                              sampling=[Sampling()] * len(ids), eod=None,
                              vocab_size=vocab)  # fmt: skip
        return time.perf_counter() - start, [c.tokens for c in done]

    return run


def _hf(hf_model, prompts: torch.Tensor):
    """A call of transformers' generate: (seconds, the new tokens per sequence)."""
    prompts = prompts.to(hf_model.device)
    mask = torch.ones_like(prompts)

    @torch.no_grad()
    def run(new_tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        out = hf_model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)  # fmt: skip
        if out.is_cuda:  # the last step's kernels may still run
            torch.cuda.synchronize(out.device)
        seconds = time.perf_counter() - start
        return seconds, out[:, prompts.shape[1] :].tolist()

    return run


if __name__ == "__main__":
    main()
