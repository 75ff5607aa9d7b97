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
measured peak of a bf16 n x n matmul (mp_train.observability.metrics.measure_peak_tflops, the
best of measures before the runs, before each round and after the runs).

    uv run python ci/bench/bench_moe.py [--seq 2048 --batch 1 --rounds 4 --warmup 1 --iters 3]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from harness import LLAMA_SHAPE
from hf_training import HF_COMMON, hf_step, mp_step, parse_arguments, report
from moe_shapes import MoeShape, attention_flops

from mp_layers import TransformerConfig

HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, _, VOCAB = LLAMA_SHAPE
EXPERTS, TOPK, EXPERT_FFN = 8, 2, 688
AUX_LOSS_COEFF = 1e-2
TARGET_RATIO = 1.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expert-ffn", type=int, default=EXPERT_FFN, help="experts' width")
    args = parse_arguments(__doc__, parser)
    shape = MoeShape(HIDDEN, LAYERS, HEADS, GROUPS, HEAD_DIM, EXPERTS, TOPK, args.expert_ffn,
                     VOCAB)  # fmt: skip
    steps = {"ours": _ours(args.seq, args.expert_ffn), "hf": _hf(args.seq, args.expert_ffn)}
    attention = LAYERS * attention_flops(args.seq, HEADS, HEAD_DIM)
    report("moe_train_iteration[bf16]", shape, steps, args, attention, TARGET_RATIO)


def _ours(seq: int, expert_ffn: int):
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=expert_ffn,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation="swiglu",
        position_embedding_type="rope", rotary_base=10000, add_bias_linear=False,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, num_moe_experts=EXPERTS, moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=TOPK, moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_grouped_gemm=True,
    )  # fmt: skip
    return mp_step(config, VOCAB, seq)


def _hf(seq: int, expert_ffn: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=expert_ffn,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
        head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
        output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEFF, router_jitter_noise=0.0,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=seq, sliding_window=None,
        attn_implementation="sdpa", **HF_COMMON,
    )  # fmt: skip
    return hf_step(transformers.MixtralForCausalLM(config))


if __name__ == "__main__":
    main()
