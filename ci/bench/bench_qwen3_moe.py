"""Benchmark: training tokens/s of a Qwen3-MoE-shaped GPTModel beside a plain loop over
transformers' Qwen3MoeForCausalLM, both starting from the same weights.

One process, both cores (torch.set_num_threads(os.cpu_count())), bf16. The model:
hidden 512, 8 layers, 8 heads of 128 channels (twice hidden / heads, as Qwen3's
attention is wider than its hidden size) in 4 query groups, qk-layernorm, RMSNorm, RoPE
(base 10,000), no biases, untied embeddings, vocabulary 32,000; every MLP a mixture of
32 SwiGLU experts of width 256 with top-8 routing and normalized top-k probabilities
(norm_topk_prob=True: mp's moe_router_pre_softmax=False), no shared expert, no capacity
limit, the load-balancing loss with coefficient 1e-2, dropout 0 (both printed: active
and total parameters).

Both sides start from the weights of one random Qwen3MoeForCausalLM, imported by
mp_ckpt.import_hf (hf_training.imported_steps): their first losses must agree.

Ours and the baseline (transformers' default experts implementation, grouped_mm, and
SDPA attention), the rounds, tokens/s and MFU: hf_training.py. MFU counts the active
parameters (the attention projections, the router, 8 experts, the output layer; 6 FLOPs
per weight and token) plus causal attention (6 L s nq d per token). Target: ours >= 1.5x
the baseline.

    uv run python ci/bench/bench_qwen3_moe.py [--seq 2048 --batch 1 --rounds 4 --warmup 1 --iters 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hf_training import HF_COMMON, imported_steps, parse_arguments, report
from moe_shapes import MoeShape, attention_flops

SHAPE = MoeShape(hidden=512, layers=8, heads=8, query_groups=4, head_dim=128, experts=32,
                 topk=8, expert_ffn=256, vocab=32000, qk_norm=True)  # fmt: skip
AUX_LOSS_COEFF = 1e-2
TARGET_RATIO = 1.5


def main() -> None:
    args = parse_arguments(__doc__)
    steps = imported_steps(_hf_model(args.seq), args.seq)
    attention = SHAPE.layers * attention_flops(args.seq, SHAPE.heads, SHAPE.head_dim)
    report("qwen3_moe_train_iteration[bf16]", SHAPE, steps, args, attention, TARGET_RATIO,
           same_weights=True)  # fmt: skip


def _hf_model(seq: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.hidden, num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.query_groups,
        head_dim=SHAPE.head_dim, num_experts=SHAPE.experts, num_experts_per_tok=SHAPE.topk,
        moe_intermediate_size=SHAPE.expert_ffn, norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=AUX_LOSS_COEFF, rms_norm_eps=1e-6, max_position_embeddings=seq,
        attn_implementation="sdpa", **HF_COMMON,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


if __name__ == "__main__":
    main()
