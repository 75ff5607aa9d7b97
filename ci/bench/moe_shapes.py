"""The model shapes of the MoE training benchmarks (bench_moe.py, bench_qwen3_moe.py,
bench_gpt_oss.py, bench_deepseek.py) and the FLOPs their MFU counts: each shape counts
its parameters exactly (hf_training.report checks both models against the count), the
active ones (what one token uses) and the active matmul weights (6 FLOPs each per token,
forward and backward), beside attention's own FLOPs (attention_flops).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeepSeekShape", "MoeShape", "attention_flops"]


@dataclass(frozen=True)
class MoeShape:
    """A MoE model of untied embeddings whose every MLP is a mixture of gated experts."""

    hidden: int
    layers: int
    heads: int
    query_groups: int
    head_dim: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int
    qk_norm: bool = False
    """RMSNorm of the queries and keys per head (Qwen3)."""
    biases: bool = False
    """Biases in q, k, v, o, the router and the experts, and one sink per head (gpt-oss)."""

    def counts(self) -> dict[str, int]:
        """total, active (what one token uses: topk of the experts) and active_matmul (the
        active matmul weights: not the embedding table, the norms, the biases)."""
        h, d, nq, ng = self.hidden, self.head_dim, self.heads, self.query_groups
        attention = h * (nq + 2 * ng) * d + nq * d * h
        router, expert = self.experts * h, 3 * h * self.expert_ffn
        small = 2 * h + (2 * d if self.qk_norm else 0)  # per layer: norms, biases, sinks
        expert_biases = 0
        if self.biases:
            small += (nq + 2 * ng) * d + h + nq + self.experts
            expert_biases = 2 * self.expert_ffn + h
        output, embedding = self.vocab * h, self.vocab * h
        active_matmul = self.layers * (attention + router + self.topk * expert) + output
        experts = self.experts * (expert + expert_biases)
        return {
            "total": self.layers * (attention + router + experts + small) + h + output + embedding,
            "active": active_matmul
            + self.layers * (small + self.topk * expert_biases)
            + h
            + embedding,
            "active_matmul": active_matmul,
        }


@dataclass(frozen=True)
class DeepSeekShape:
    """A DeepSeek-V3-style model of untied embeddings: multi-latent attention in every
    layer (a query latent of q_lora_rank, a key/value latent of kv_lora_rank), a dense
    SwiGLU MLP of `ffn` in the first `dense_layers`, then routed SwiGLU experts beside
    `shared_experts` shared ones of the experts' width."""

    hidden: int
    layers: int
    dense_layers: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    ffn: int
    experts: int
    topk: int
    expert_ffn: int
    shared_experts: int
    vocab: int

    def counts(self) -> dict[str, int]:
        """total, active and active_matmul as MoeShape's (an expert layer's active experts:
        topk routed and the shared ones); mtp: the parameters one multi-token prediction
        module adds (enorm, hnorm, eh_proj [h, 2h], a layer shaped as the last, its final
        norm; it shares the embedding and the output layer), mtp_active_matmul its active
        matmul weights (eh_proj, the layer's, the output layer once more)."""
        h, n, rq, r = self.hidden, self.heads, self.q_lora_rank, self.kv_lora_rank
        dn, dr, dv = self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim
        attention = h * rq + rq * n * (dn + dr) + h * (r + dr) + r * n * (dn + dv) + n * dv * h
        norms = 2 * h + rq + r  # per layer: the two layer norms and the two latent norms
        expert = 3 * h * self.expert_ffn
        router, shared = self.experts * h, self.shared_experts * expert
        moe_layers = self.layers - self.dense_layers
        active_mlp = router + self.topk * expert + shared
        all_mlp = router + self.experts * expert + shared
        dense_mlp = 3 * h * self.ffn
        output = embedding = self.vocab * h
        active_matmul = (self.layers * attention + self.dense_layers * dense_mlp
                         + moe_layers * active_mlp + output)  # fmt: skip
        return {
            "total": self.layers * (attention + norms)
            + self.dense_layers * dense_mlp
            + moe_layers * all_mlp
            + h
            + output
            + embedding,
            "active": active_matmul + self.layers * norms + h + embedding,
            "active_matmul": active_matmul,
            "mtp": 2 * h + 2 * h * h + attention + norms + all_mlp + h,
            "mtp_active_matmul": 2 * h * h + attention + active_mlp + output,
        }


def attention_flops(seq: int, heads: int, head_dim: int, window: int | None = None,
                    value_dim: int | None = None) -> float:  # fmt: skip
    """Per token and layer, forward and backward: the scores and the weighted sum over the
    keys a query attends to (12 nq d per key; s / 2 keys on average when causal, 6 s nq d),
    or over a sliding window of `window` keys before it and itself. value_dim: the values'
    channels where they differ from the queries' and keys' head_dim (multi-latent
    attention): 6 nq (head_dim + value_dim) per key."""
    keys = seq / 2 if window is None else sum(min(i, window) + 1 for i in range(seq)) / seq
    return 6 * heads * (head_dim + (head_dim if value_dim is None else value_dim)) * keys
