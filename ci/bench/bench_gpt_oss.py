"""Benchmark: training tokens/s of a gpt-oss-shaped GPTModel beside a plain loop over
transformers' GptOssForCausalLM, both starting from the same weights.

One process, both cores (torch.set_num_threads(os.cpu_count())), bf16. The model:
gpt-oss's layers at bench_moe.py's size: hidden 512, 8 layers, 8 heads of 64 channels in
4 query groups, RMSNorm, untied embeddings, vocabulary 32,000; gpt-oss's attention: a
learnable sink per head (softmax_type="learnable"), a sliding window of 128 keys
(window_size=(127, 0)) on alternate layers from the first (window_attn_skip_freq=2; the
others attend to the whole causal prefix), biases on q, k, v and o, YaRN rotary
(gpt-oss's settings: base 150,000, factor 32 over 4,096 original positions, beta 32 and
1, ends not rounded); gpt-oss's MLP in every layer: 32 experts of width 256 with top-4
routing (a softmax over the 4 largest logits of a router with a bias), the clamped quick
GEGLU g sigmoid(1.702 g) (u + 1) with g <= 7 and |u| <= 7 (quick_geglu,
glu_linear_offset=1, activation_func_clamp_value=7), biases on both expert matmuls, no
capacity limit, the load-balancing loss with coefficient 1e-2, dropout 0.

Both sides start from the weights of one random GptOssForCausalLM, imported by
mp_ckpt.import_hf (hf_training.imported_steps): their first losses must agree.

Ours and the baseline (transformers' default experts implementation, grouped_mm, and
its eager attention: gpt-oss's sinks have no SDPA path in transformers, and
flex_attention no CPU backward in torch 2.15), the rounds, tokens/s and MFU:
hf_training.py. MFU counts the active parameters (the attention projections, the
router, 4 experts, the output layer; 6 FLOPs per weight and token) plus attention: 6 L s
nq d per token over the full layers, 12 nq d per key attended over the windowed ones.
Target: ours >= 1.3x the baseline.

    uv run python ci/bench/bench_gpt_oss.py [--seq 2048 --batch 1 --rounds 4 --warmup 1 --iters 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hf_training import HF_COMMON, draw_normal, imported_steps, parse_arguments, report
from moe_shapes import MoeShape, attention_flops

SHAPE = MoeShape(hidden=512, layers=8, heads=8, query_groups=4, head_dim=64, experts=32,
                 topk=4, expert_ffn=256, vocab=32000, biases=True)  # fmt: skip
WINDOW = 128
"""Hugging Face's sliding_window: the keys a windowed layer's query sees, itself included."""
AUX_LOSS_COEFF = 1e-2
TARGET_RATIO = 1.3


def main() -> None:
    args = parse_arguments(__doc__)
    steps = imported_steps(_hf_model(), args.seq)
    windowed = (SHAPE.layers + 1) // 2  # layers 0, 2, 4, ...
    per_layer = {w: attention_flops(args.seq, SHAPE.heads, SHAPE.head_dim, w)
                 for w in (WINDOW - 1, None)}  # fmt: skip
    attention = windowed * per_layer[WINDOW - 1] + (SHAPE.layers - windowed) * per_layer[None]
    report("gpt_oss_train_iteration[bf16]", SHAPE, steps, args, attention, TARGET_RATIO,
           same_weights=True, window=WINDOW)  # fmt: skip


def _hf_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.hidden, num_hidden_layers=SHAPE.layers,
        num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.query_groups,
        head_dim=SHAPE.head_dim, num_local_experts=SHAPE.experts,
        num_experts_per_tok=SHAPE.topk, intermediate_size=SHAPE.expert_ffn,
        sliding_window=WINDOW, output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEFF,
        attn_implementation="eager", **HF_COMMON,
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config)
    draw_normal(model.named_parameters(), "bias", config.initializer_range)
    return model


if __name__ == "__main__":
    main()
