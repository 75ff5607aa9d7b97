"""Measure: what a DeepSeek sparse attention layer keeps for backward in training, and its
forward + backward time, with its indexer's per-head products computed a block of queries
at a time and recomputed in backward (mp's default, sparse_attention.CHUNK_BYTES of 256
MiB) against computed whole and kept.

One multi-latent attention layer (hidden 256, 4 heads, query latent 64, key/value latent
32) with DeepSeek-V3.2's indexer (64 heads of 128 channels, top 512), the indexer loss on,
on one thread of this CPU, one sample of 2,048 tokens in fp32: the indexer's products
[s, n, s] are 1 GiB, four blocks of 512 queries. Kept bytes: the storages autograd saves
for backward in one forward (saved-tensor hooks; the layer's parameters and input left
out), per token. Time: after a warm-up call each, the two sides alternate (the order
flipped every round) for `--repeats` rounds; best and median of each.

    uv run python ci/bench/bench_dsa_memory.py [--repeats 3]
"""

from __future__ import annotations

import argparse

from bench_mamba_recompute import measure_recompute, report
from harness import context

TOKENS = 2048


class Blocks:
    """measure_recompute's switch: `recompute` True computes the products in blocks
    (mp's default), False whole."""

    def __init__(self) -> None:
        from mp_layers.transformer import sparse_attention

        self.module, self.default = sparse_attention, sparse_attention.CHUNK_BYTES

    @property
    def recompute(self) -> bool:
        return self.default == self.module.CHUNK_BYTES

    @recompute.setter
    def recompute(self, on: bool) -> None:
        self.module.CHUNK_BYTES = self.default if on else 2**62


def main() -> None:
    import torch

    from mp_layers import ModelGroups, TransformerConfig
    from mp_layers.transformer.multi_latent_attention import MultiLatentAttention
    from mp_layers.transformer.rope import RotaryEmbedding
    from mp_layers.transformer.spec import LOCAL_SPEC

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=4, multi_latent_attention=True,
        q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16,
        v_head_dim=32, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
        position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
        attention_backend="flash", experimental_attention_variant="dsa",
        dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=512,
        dsa_indexer_loss_coeff=0.01,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = MultiLatentAttention(config, ModelGroups.single(), spec=LOCAL_SPEC).train()
    rotary = RotaryEmbedding(16, 1.0, 10000)(TOKENS)

    class Output(torch.nn.Module):
        """The layer's output alone (it returns (output, bias))."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, rotary)[0]

    x = torch.randn(TOKENS, 1, 256, requires_grad=True)
    kept, times = measure_recompute(Output(), Blocks(), x, args.repeats)
    report("dsa_indexer_blocks", "fp32", TOKENS, kept, times, context())


if __name__ == "__main__":
    main()
