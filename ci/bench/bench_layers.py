"""Benchmark: training-step tokens/s of GPTModel beside transformers' LlamaForCausalLM.

One process, all cores (torch.set_num_threads(os.cpu_count())). A ~56M-
parameter Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention,
no biases, untied embeddings: hidden 512, 8 layers, 8 heads in 4 query
groups of 64 channels, ffn 1376, vocabulary 32000), sequence 512, batch 4,
dropout 0, built twice from configs of the same shape (no download): our
GPTModel on one tensor-parallel rank and transformers' LlamaForCausalLM
(SDPA attention). A step is forward with labels -> loss.mean() (ours returns
the per-token loss [b, s], transformers' the mean already) -> backward ->
zero grads (set to None). In bf16 the whole step runs under
torch.autocast("cpu", dtype=torch.bfloat16) with fp32 parameters; the
backward runs inside the autocast region too, because our tensor-parallel
linears (custom autograd Functions without torch.amp.custom_fwd/custom_bwd)
fail with a dtype mismatch when backward runs outside it.

After warm-up steps the two models' steps alternate (so that load from other
processes hits both alike); tokens/s comes from the fastest step of each
(harness.best_of), the median beside it. Target: ours >= 1.2x transformers.

Achieved FLOP/s uses Megatron's per-token training FLOPs (forward 2, backward
4 FLOPs per weight of every matmul; the attention scores and the weighted sum
of values, 2 * 2 * s * nq * d per token and layer forward, counted for the
full s x s square as Megatron does, although causal kernels skip half):

    flops_per_token = 6 * N_matmul + 12 * L * s * nq * d
    N_matmul = L * (h * (nq + 2 * ng) * d + nq * d * h + 3 * h * f) + h * V

(h hidden, L layers, nq query heads, ng query groups, d head channels,
f ffn, V vocabulary; the embedding lookup is no matmul). The fraction is of
the measured peak of the same dtype: the best of a few square n x n
torch.matmul, 2 n^3 / t.

--fixes also times candidate speed-ups of ours, each applied by monkeypatching
in this process (nothing under packages/ changes): the pieces alone (forward +
backward of core attention, RoPE, cross entropy, linear) and the whole step
with all of them.

    uv run --no-sync python ci/bench/bench_layers.py [--fixes]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from harness import best_of, context, emit

import mp_layers.gpt_model as gpt_model_module
import mp_layers.transformer.attention as attention_module
from mp_layers import ColumnParallelLinear, GPTModel, TransformerConfig
from mp_layers.tensor_parallel import vocab_parallel_cross_entropy
from mp_layers.transformer.core_attention import CoreAttention
from mp_layers.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from mp_state import RankGroup

HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 512, 8, 8, 4, 64, 1376, 32000
TARGET_RATIO = 1.2
ONE_RANK = RankGroup("tp", (0,), 0, None)
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model")
    parser.add_argument("--peak-n", type=int, default=2048, help="n of the n x n matmul peak")
    parser.add_argument("--fixes", action="store_true", help="also time candidate fixes")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ctx = context()

    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[name] = _matmul_peak(args.peak_n, dtype)
        emit(
            f"matmul_peak[{name}]",
            {"tflops": round(peaks[name] / 1e12, 4), "n": args.peak_n, "repeats": 5},
            ctx,
        )

    torch.manual_seed(0)
    ours, hf = _ours(args.seq), _hf(args.seq)
    params = sum(p.numel() for p in ours.parameters())
    hf_params = sum(p.numel() for p in hf.parameters())
    print(f"parameters: ours {params:,}, transformers {hf_params:,}", flush=True)
    flops_per_token = _flops_per_token(args.seq)
    tokens = args.batch * args.seq
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator)

    def ours_step() -> None:
        ours(ids, labels=labels).mean().backward()
        ours.zero_grad(set_to_none=True)

    def hf_step() -> None:
        hf(input_ids=ids, labels=labels).loss.backward()
        hf.zero_grad(set_to_none=True)

    shape = {
        "parameters": params, "hf_parameters": hf_params, "hidden": HIDDEN, "layers": LAYERS,
        "heads": HEADS, "query_groups": GROUPS, "ffn": FFN, "vocab": VOCAB,
        "sequence_length": args.seq, "batch": args.batch,
        "flops_per_token": flops_per_token, "timed_steps": args.steps,
    }  # fmt: skip
    for name, dtype in DTYPES.items():
        times = _interleaved({"ours": ours_step, "hf": hf_step}, dtype, args.warmup, args.steps)
        best = {k: min(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        ratio = best["hf"] / best["ours"]
        achieved = flops_per_token * tokens / best["ours"]
        emit(
            f"gpt_train_step[{name}]",
            {
                "tokens_per_s": round(tokens / best["ours"], 1),
                "hf_tokens_per_s": round(tokens / best["hf"], 1),
                "ratio_to_hf": round(ratio, 3),
                "ratio_to_hf_median": round(median["hf"] / median["ours"], 3),
                "target_ratio": TARGET_RATIO,
                "meets_target": ratio >= TARGET_RATIO,
                "step_s": round(best["ours"], 3),
                "hf_step_s": round(best["hf"], 3),
                "step_s_median": round(median["ours"], 3),
                "hf_step_s_median": round(median["hf"], 3),
                "achieved_tflops": round(achieved / 1e12, 4),
                "hf_achieved_tflops": round(flops_per_token * tokens / best["hf"] / 1e12, 4),
                "fraction_of_matmul_peak": round(achieved / peaks[name], 3),
                "matmul_peak_tflops": round(peaks[name] / 1e12, 4),
                **shape,
            },
            ctx,
        )

    if args.fixes:
        _fix_pieces(args, ctx)
        for name, dtype in DTYPES.items():
            with _all_fixes():
                patched = {"ours_fixed": ours_step, "ours": _unpatched(ours_step)}
                times = _interleaved(patched | {"hf": hf_step}, dtype, 1, args.steps)
            best = {k: min(v) for k, v in times.items()}
            emit(
                f"gpt_train_step_all_fixes[{name}]",
                {
                    "fixes": sorted(FIXES),
                    "tokens_per_s_fixed": round(tokens / best["ours_fixed"], 1),
                    "tokens_per_s": round(tokens / best["ours"], 1),
                    "hf_tokens_per_s": round(tokens / best["hf"], 1),
                    "speedup_of_fixes": round(best["ours"] / best["ours_fixed"], 3),
                    "ratio_to_hf_fixed": round(best["hf"] / best["ours_fixed"], 3),
                    "ratio_to_hf": round(best["hf"] / best["ours"], 3),
                    **shape,
                },
                ctx,
            )


# The models.


def _config(seq: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation="swiglu",
        position_embedding_type="rope", rotary_base=10000, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


def _ours(seq: int) -> GPTModel:
    # GPTModel takes a layer spec ("local") after the config where mp-layers has specs.
    spec = ("local",) if "spec" in inspect.signature(GPTModel).parameters else ()
    return GPTModel(_config(seq), *spec, VOCAB, seq, tp_group=ONE_RANK).train()


def _hf(seq: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=seq,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _flops_per_token(seq: int) -> int:
    """Megatron's training FLOPs per token (see the module docstring)."""
    attention_width = HEADS * HEAD_DIM
    per_layer = (
        HIDDEN * (HEADS + 2 * GROUPS) * HEAD_DIM + attention_width * HIDDEN + 3 * HIDDEN * FFN
    )
    matmul_weights = LAYERS * per_layer + HIDDEN * VOCAB
    return 6 * matmul_weights + 12 * LAYERS * seq * attention_width


# Timing.


def _matmul_peak(n: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    seconds, _ = best_of(5, torch.matmul, a, b)
    return 2 * n**3 / seconds


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _interleaved(
    steps: dict[str, Callable[[], None]], dtype: torch.dtype | None, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds of each timed call, the functions taking turns."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    with _autocast(dtype):
        for function in steps.values():
            for _ in range(warmup):
                function()
        for _ in range(repeats):
            for name, function in steps.items():
                seconds, _ = best_of(1, function)
                times[name].append(seconds)
    return times


def _fwd_bwd(
    function: Callable[..., torch.Tensor], inputs: list[torch.Tensor], repeats: int = 7
) -> float:
    """Best seconds of function(*inputs).sum().backward() (after one warm-up)."""

    def once() -> None:
        for t in inputs:
            t.grad = None
        function(*inputs).float().sum().backward()

    once()
    seconds, _ = best_of(repeats, once)
    return seconds


# Candidate fixes, applied by monkeypatching.


def _core_attention_gqa(self, q, k, v, attention_mask=None):
    """CoreAttention.forward with SDPA's enable_gqa instead of repeat_interleave of k and v."""
    s, b, nq, d = q.shape
    q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    dropout = self.attention_dropout if self.training else 0.0
    kwargs: dict[str, Any] = {"dropout_p": dropout, "scale": 1.0 / math.sqrt(d)}
    if attention_mask is None:
        kwargs["is_causal"] = True
    else:
        kwargs["attn_mask"] = ~attention_mask
    kwargs["enable_gqa"] = nq != k.shape[2]
    out = F.scaled_dot_product_attention(q_, k_, v_, **kwargs)  # dropout 0 in this benchmark
    return out.permute(2, 0, 1, 3).reshape(s, b, nq * d)


_ROPE_CACHE: dict[str, Any] = {}


def _rope_cached(t: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb with cos/sin computed once per angles tensor (once per forward)
    instead of twice per layer."""
    key = (t.dtype,)
    if _ROPE_CACHE.get("angles") is not angles or _ROPE_CACHE.get("key") != key:
        _ROPE_CACHE.update(
            angles=angles, key=key, cos=angles.cos().to(t.dtype), sin=angles.sin().to(t.dtype)
        )
    cos, sin = _ROPE_CACHE["cos"], _ROPE_CACHE["sin"]
    rot = angles.shape[-1]
    t_rot = t[..., :rot] if rot < t.shape[-1] else t
    first, second = t_rot.chunk(2, dim=-1)
    rotated = t_rot * cos + torch.cat([-second, first], dim=-1) * sin
    return rotated if rot == t.shape[-1] else torch.cat([rotated, t[..., rot:]], dim=-1)


class _CrossEntropyOneRank(torch.autograd.Function):
    """vocab_parallel_cross_entropy at TP=1 (no label smoothing) with fewer passes over
    [s, b, v]: exp in place of the shifted copy, softmax scaled by the incoming gradient
    in one pass in backward (no clone, no separate mul_)."""

    @staticmethod
    def forward(ctx, logits, target):
        x = logits.float()
        shifted = x - x.amax(dim=-1, keepdim=True)
        predicted = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log_() - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target = ctx.saved_tensors
        grad = softmax * grad_loss.unsqueeze(-1)
        grad.scatter_add_(-1, target.unsqueeze(-1), -grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def _cross_entropy_one_rank(logits, target, tp_group, label_smoothing=0.0):
    if tp_group.size > 1 or label_smoothing > 0:
        return vocab_parallel_cross_entropy(logits, target, tp_group, label_smoothing)
    return _CrossEntropyOneRank.apply(logits, target)


def _cross_entropy_torch(logits, target, tp_group, label_smoothing=0.0):
    """F.cross_entropy (log_softmax + nll) at TP=1, as transformers computes it."""
    if tp_group.size > 1 or label_smoothing > 0:
        return vocab_parallel_cross_entropy(logits, target, tp_group, label_smoothing)
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)


_COLUMN_FORWARD = ColumnParallelLinear.forward


def _column_linear(self, input):
    """ColumnParallelLinear.forward with F.linear at TP=1 (no custom autograd Function)."""
    if self.tp_group.size > 1 or self.sequence_parallel or self.gather_output:
        return _COLUMN_FORWARD(self, input)
    bias = None if self.skip_bias_add else self.bias
    return F.linear(input, self.weight, bias), (self.bias if self.skip_bias_add else None)


FIXES = {
    "core_attention_enable_gqa": (CoreAttention, "forward", _core_attention_gqa),
    "rope_cos_sin_once": (attention_module, "apply_rotary_pos_emb", _rope_cached),
    "cross_entropy_fewer_passes": (
        gpt_model_module, "vocab_parallel_cross_entropy", _cross_entropy_one_rank,
    ),
    "column_linear_f_linear_at_tp1": (ColumnParallelLinear, "forward", _column_linear),
}  # fmt: skip
_ORIGINAL = {name: getattr(owner, attr) for name, (owner, attr, _) in FIXES.items()}


@contextlib.contextmanager
def _all_fixes():
    for owner, attr, patch in FIXES.values():
        setattr(owner, attr, patch)
    try:
        yield
    finally:
        for name, (owner, attr, _) in FIXES.items():
            setattr(owner, attr, _ORIGINAL[name])


def _unpatched(step: Callable[[], None]) -> Callable[[], None]:
    """step with the original code, called while the fixes are patched in."""

    def run() -> None:
        for name, (owner, attr, _) in FIXES.items():
            setattr(owner, attr, _ORIGINAL[name])
        try:
            step()
        finally:
            for owner, attr, patch in FIXES.values():
                setattr(owner, attr, patch)

    return run


def _fix_pieces(args: argparse.Namespace, ctx: dict[str, Any]) -> None:
    """Forward + backward of each piece alone, current code beside the candidate fix, for
    all the layers of one step (times the per-call seconds by the calls per step)."""
    s, b = args.seq, args.batch
    for name, dtype in DTYPES.items():
        act = dtype or torch.float32  # the dtype the matmuls hand the pieces under autocast
        rows: dict[str, tuple[float, float, int, str]] = {}
        with _autocast(dtype):
            q = torch.randn(s, b, HEADS, HEAD_DIM, dtype=act, requires_grad=True)
            k = torch.randn(s, b, GROUPS, HEAD_DIM, dtype=act, requires_grad=True)
            v = torch.randn(s, b, GROUPS, HEAD_DIM, dtype=act, requires_grad=True)
            core = CoreAttention(0.0, None)
            rows["core_attention_enable_gqa"] = (
                _fwd_bwd(core, [q, k, v]),
                _fwd_bwd(lambda *t: _core_attention_gqa(core, *t), [q, k, v]),
                LAYERS,
                "CoreAttention: repeat_interleave(k, v) + SDPA vs SDPA(enable_gqa=True)",
            )
            rotary = RotaryEmbedding(HEAD_DIM)

            def rope(function, q, k):
                angles = rotary(s)
                total = 0
                for _ in range(LAYERS):
                    total = total + function(q, angles).sum() + function(k, angles).sum()
                return total

            rows["rope_cos_sin_once"] = (
                _fwd_bwd(lambda q, k: rope(apply_rotary_pos_emb, q, k), [q, k]),
                _fwd_bwd(lambda q, k: rope(_rope_cached, q, k), [q, k]),
                1,
                "RoPE of q and k in all layers: cos/sin per call vs once per forward",
            )
            logits = torch.randn(s, b, VOCAB, dtype=act, requires_grad=True)
            target = torch.randint(0, VOCAB, (s, b))
            ours_ce = _fwd_bwd(lambda x: vocab_parallel_cross_entropy(x, target, ONE_RANK), [logits])
            rows["cross_entropy_fewer_passes"] = (
                ours_ce,
                _fwd_bwd(lambda x: _cross_entropy_one_rank(x, target, ONE_RANK), [logits]),
                1,
                "loss over [s, b, v]: vocab_parallel_cross_entropy vs one fewer pass each way",
            )
            rows["cross_entropy_torch"] = (
                ours_ce,
                _fwd_bwd(lambda x: _cross_entropy_torch(x, target, ONE_RANK), [logits]),
                1,
                "loss over [s, b, v]: vocab_parallel_cross_entropy vs F.cross_entropy",
            )
            del logits
            x = torch.randn(s, b, HIDDEN, requires_grad=True)
            fc1 = ColumnParallelLinear(
                HIDDEN, 2 * FFN, tp_group=ONE_RANK, bias=False, init_method=torch.nn.init.normal_
            )
            rows["column_linear_f_linear_at_tp1"] = (
                _fwd_bwd(lambda x: _COLUMN_FORWARD(fc1, x)[0], [x]),
                _fwd_bwd(lambda x: _column_linear(fc1, x)[0], [x]),
                LAYERS,
                "fc1 [h -> 2f]: _ColumnParallelMatmul vs F.linear",
            )
            norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
            rows["rmsnorm_torch_vs_hf"] = (
                _fwd_bwd(norm, [x]),
                _fwd_bwd(lambda x: _hf_rms_norm(x, norm.weight), [x]),
                2 * LAYERS + 1,
                "torch.nn.RMSNorm (ours) vs transformers' LlamaRMSNorm formula",
            )
        for piece, (current, candidate, calls, what) in rows.items():
            emit(
                f"layers_piece[{piece},{name}]",
                {
                    "what": what,
                    "current_ms": round(current * 1e3, 2),
                    "candidate_ms": round(candidate * 1e3, 2),
                    "calls_per_step": calls,
                    "saved_ms_per_step": round((current - candidate) * calls * 1e3, 1),
                    "sequence_length": s,
                    "batch": b,
                },
                ctx,
            )


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * x.to(dtype)


if __name__ == "__main__":
    main()
