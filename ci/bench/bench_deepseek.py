"""Benchmark: a DeepSeek-V3-shaped GPTModel beside transformers' DeepseekV3ForCausalLM
from the same weights: training tokens/s (`train`) and the time per new generated token
(`generate`).

One process, both cores (torch.set_num_threads(os.cpu_count())). The model: DeepSeek-V3's
layers at the size of the other MoE benchmarks: hidden 512, 8 layers, the first with a
dense SwiGLU MLP of 1,280 (DeepSeek-V3's dense width is its experts' times the 8 routed
and 1 shared it runs per token: here 5 x 256), the others 32 routed SwiGLU experts of
width 256 beside 1 shared expert of that width; multi-latent attention with 8 heads, a
query latent of 192 and a key/value latent of 128 (DeepSeek-V3's 1,536 and 512 at hidden
7,168, scaled), 64 + 32 query/key channels per head (without and with rotary) and 64
value channels; RMSNorm (eps 1e-6), untied embeddings, vocabulary 32,000, dropout 0.
DeepSeek-V3's routing: sigmoid scores plus a correction bias (drawn normal(0, 0.02) here,
transformers starts it at 0) choose the top 4 experts within the best 2 of 8 groups of 4
(a group ranked by its 2 best: 4 // 2 as mp ranks them), their scores renormalized and
scaled by 2.5; no load-balancing loss (transformers has none for DeepSeek-V3; ours imports
aux_loss_alpha 0). DeepSeek-V3's YaRN: base 10,000, factor 40 over 4,096 original
positions, beta 32 and 1, mscale and mscale_all_dim 1 (the softmax scaled by mscale^2).

Both sides start from the weights of one random DeepseekV3ForCausalLM (transformers'
initialization, seed 0), imported by mp_ckpt.import_hf.

train: hf_training.py's two sides, rounds and figures (imported_steps: ours with bf16
parameters and grouped expert matmuls in mp_optim's DDP and mixed-precision optimizer;
the baseline a hand-written loop over transformers' model in bf16, its correction bias
kept in fp32 as transformers loads it, its default experts implementation grouped_mm and
SDPA attention). The first losses must agree. transformers' model has no multi-token
prediction, so the comparison runs ours without it; a third side in the same rounds,
ours_mtp, is ours with one MTP module (DeepSeek-V3's, mtp_loss_scaling_factor 0.1, its
own initialization; the rest the same weights) as an extra figure, not the comparison's.
MFU counts the active parameters (the attention projections, the dense MLP, the router,
4 routed and the shared expert, the output layer; 6 FLOPs per weight and token) plus
causal attention (6 L s n (96 + 64) / 2 per token); ours_mtp's adds its module's (eh_proj,
a layer, the output layer once more). Target: ours >= 1.5x the baseline.

generate: bench_generate.py's comparison (compare, run_comparisons): b prompts of random
ids, greedy, exactly --new-tokens new tokens; prefill tokens/s and per-new-token time,
best and median over rounds; ours is mp_gpt.generate.Generator over the imported
checkpoint with --moe-grouped-gemm (the experts' kernel of the training side and of
transformers' default), which caches each position's key/value latent and rotated key
(160 channels a layer) and attends in the latent space; transformers' generate caches the
same latents and expands them into every head's keys and values at each step. Target:
ours <= 1.0x the baseline's time per token.

    uv run python ci/bench/bench_deepseek.py train [--seq 2048 --batch 1 --rounds 4
        --warmup 1 --iters 3]
    uv run python ci/bench/bench_deepseek.py generate [--batch-sizes 1 8 --new-tokens 512
        --prompt-len 128 --rounds 3 --dtypes bf16 fp32]
    uv run python ci/bench/bench_deepseek.py generate --quick   # 32 new tokens, 1 round, bf16
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from bench_generate import (
    add_generation_arguments,
    imported_generator,
    run_comparisons,
    settle_generation_arguments,
)
from hf_training import HF_COMMON, Side, add_training_arguments, draw_normal, imported_steps, report
from moe_shapes import DeepSeekShape, attention_flops

SHAPE = DeepSeekShape(hidden=512, layers=8, dense_layers=1, heads=8, q_lora_rank=192,
                      kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64,
                      ffn=1280, experts=32, topk=4, expert_ffn=256, shared_experts=1,
                      vocab=32000)  # fmt: skip
GROUPS, GROUPS_KEPT = 8, 2
"""n_group, topk_group: DeepSeek-V3's 8 and 4 of 256 experts (top 8) over 32 experts
(top 4); topk // topk_group = 2, the best scores DeepSeek ranks a group by."""
ROUTED_SCALING_FACTOR = 2.5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}  # fmt: skip
"""DeepSeek-V3's rope_scaling."""
MAX_POSITIONS = 163840  # DeepSeek-V3's: 40 x 4,096
MTP_LAYERS = 1
TRAIN_TARGET_RATIO = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_training_arguments(commands.add_parser("train", help="training tokens/s"))
    add_generation_arguments(commands.add_parser("generate", help="time per new token"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.command == "train":
        _train(args)
    else:
        _generate(settle_generation_arguments(parser, args))


def _train(args: argparse.Namespace) -> None:
    steps = imported_steps(_hf_model(), args.seq, {"ours_mtp": {"mtp_num_layers": MTP_LAYERS}},
                           fresh=("mtp.",))  # fmt: skip
    counts = SHAPE.counts()
    per_layer = attention_flops(args.seq, SHAPE.heads,
                                SHAPE.qk_head_dim + SHAPE.qk_pos_emb_head_dim,
                                value_dim=SHAPE.v_head_dim)  # fmt: skip
    mtp = Side(
        parameters=counts["total"] + MTP_LAYERS * counts["mtp"],
        flops_per_token=6 * (counts["active_matmul"] + MTP_LAYERS * counts["mtp_active_matmul"])
        + (SHAPE.layers + MTP_LAYERS) * per_layer,
    )
    report("deepseek_v3_train_iteration[bf16]", SHAPE, steps, args, SHAPE.layers * per_layer,
           TRAIN_TARGET_RATIO, same_weights=True, sides={"ours_mtp": mtp},
           groups=GROUPS, groups_kept=GROUPS_KEPT, mtp_layers=MTP_LAYERS)  # fmt: skip


def _generate(args: argparse.Namespace) -> None:
    hf_model = _hf_model().eval()
    with tempfile.TemporaryDirectory() as scratch:
        ours = imported_generator(hf_model, Path(scratch), ["--moe-grouped-gemm"])
    run_comparisons("deepseek_v3_generate_per_token", ours, hf_model, args, SHAPE)


def _hf_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.hidden, num_hidden_layers=SHAPE.layers,
        first_k_dense_replace=SHAPE.dense_layers, intermediate_size=SHAPE.ffn,
        num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.heads,
        q_lora_rank=SHAPE.q_lora_rank, kv_lora_rank=SHAPE.kv_lora_rank,
        qk_nope_head_dim=SHAPE.qk_head_dim, qk_rope_head_dim=SHAPE.qk_pos_emb_head_dim,
        v_head_dim=SHAPE.v_head_dim, n_routed_experts=SHAPE.experts,
        num_experts_per_tok=SHAPE.topk, moe_intermediate_size=SHAPE.expert_ffn,
        n_shared_experts=SHAPE.shared_experts, n_group=GROUPS, topk_group=GROUPS_KEPT,
        norm_topk_prob=True, routed_scaling_factor=ROUTED_SCALING_FACTOR,
        num_nextn_predict_layers=0, rope_parameters=YARN, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6, attn_implementation="sdpa", **HF_COMMON,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config)
    draw_normal(model.named_buffers(), "e_score_correction_bias", config.initializer_range)
    return model


if __name__ == "__main__":
    main()
