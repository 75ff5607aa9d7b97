"""Measure: what DeepSeek-V3's layers keep for backward in training, and their forward +
backward time, under Megatron's fine-grained recompute (--recompute-granularity selective
--recompute-modules ...), each setting against none.

The model: bench_deepseek.py's layers (hidden 512, multi-latent attention with 8 heads, a
query latent of 192 and a key/value latent of 128, 64 + 32 query/key channels and 64 value
channels per head; the first layer a dense SwiGLU MLP of 1,280, the second 32 routed
SwiGLU experts of 256, top 4 with sigmoid scores, beside one shared expert of 256; grouped
expert matmuls; RMSNorm, no biases, dropout 0), vocabulary 1,024 (the output layer a small
share), one sample of 1,024 tokens, fp32, one thread. Settings: none; each of layernorm,
moe_act, mla_up_proj and shared_experts alone; the three output-discarding ones together
(Megatron's DeepSeek-V3 line); and with core_attn and shared_experts too. Every model is
drawn from the same seed (the same weights).

Kept bytes: the storages autograd saves for backward in one forward (saved-tensor hooks;
parameters left out; a discarded output counts as the 0 bytes it holds then), per token.
Time: after a warm-up step each, the settings take turns (the order reversed every round)
for `--repeats` rounds; best and median of each, and each best over none's.

    uv run python ci/bench/bench_recompute_modules.py [--repeats 5 --seq 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import context, emit

SETTINGS = {
    "none": None,
    "layernorm": ["layernorm"],
    "moe_act": ["moe_act"],
    "mla_up_proj": ["mla_up_proj"],
    "shared_experts": ["shared_experts"],
    "mla_up_proj+layernorm+moe_act": ["mla_up_proj", "layernorm", "moe_act"],
    "all": ["core_attn", "mla_up_proj", "layernorm", "moe_act", "shared_experts"],
}
VOCAB = 1024


def build(modules, seq: int):
    import torch

    from mp_layers import GPTModel, ModelGroups, TransformerConfig

    recompute = {} if modules is None else dict(recompute_granularity="selective",
                                                recompute_modules=modules)  # fmt: skip
    config = TransformerConfig(
        num_layers=2, hidden_size=512, num_attention_heads=8, multi_latent_attention=True,
        q_lora_rank=192, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32,
        v_head_dim=64, qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        position_embedding_type="rope", activation="swiglu", ffn_hidden_size=1280,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=32, moe_layer_freq=[0, 1], moe_ffn_hidden_size=256, moe_router_topk=4,
        moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=256,
        moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, untie_embeddings_and_output_weights=True,
        **recompute,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPTModel(config, "local", VOCAB, seq, groups=ModelGroups.single()).train()


def kept_bytes(model, ids, labels) -> int:
    import torch

    saved: list = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(ids, labels=labels).mean()
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    kept = sum(n for ptr, n in storages.items() if ptr not in own and ptr != 0)
    loss.backward()
    return kept


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=generator)
    labels = torch.randint(0, VOCAB, (1, args.seq), generator=generator)
    models = {name: build(modules, args.seq) for name, modules in SETTINGS.items()}
    kept = {name: kept_bytes(model, ids, labels) / args.seq for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    losses = {}
    order = list(models)
    for _ in range(args.repeats):
        for name in order:
            model = models[name]
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = model(ids, labels=labels).mean()
            loss.backward()
            times[name].append(time.perf_counter() - start)
            losses[name] = loss.item()
        order.reverse()
    assert len(set(losses.values())) == 1, losses  # the same model and step in each setting
    best = {name: min(t) for name, t in times.items()}
    emit("recompute_modules", {
        "dtype": "fp32", "tokens": args.seq, "repeats": args.repeats,
        "kept_bytes_per_token": {n: round(v) for n, v in kept.items()},
        "kept_over_none": {n: round(v / kept["none"], 3) for n, v in kept.items()},
        "best_ms": {n: round(v * 1e3, 1) for n, v in best.items()},
        "median_ms": {n: round(statistics.median(t) * 1e3, 1) for n, t in times.items()},
        "time_over_none": {n: round(v / best["none"], 3) for n, v in best.items()},
    }, context())  # fmt: skip


if __name__ == "__main__":
    main()
