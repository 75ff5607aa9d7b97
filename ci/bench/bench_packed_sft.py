"""Benchmark: training tokens/s on packed conversations beside the same ones padded.

One process, all cores, bf16 autocast over fp32 weights, AdamW. Conversations of random
lengths averaging `--mean` tokens (300; uniform between 1/6 and 11/6 of it, seed 0) are
packed greedily, in order, into samples of `--seq` positions (4096) without splitting
one (mp_data.pack_conversations, as the SFT data packs them); each training step takes
the conversations of one packed sample, three ways, taking turns:

- packed: the one sample, its documents kept apart by PackedSeqParams (each attended
  on its own), the tail padding masked out;
- padded: one sample per conversation, each padded to `--seq` (Megatron's unpacked SFT
  samples: every sample the sequence length);
- padded-longest: one sample per conversation, padded to the longest of the step's
  (a dynamic-padding collator's batches).

The same Llama-style model (hidden 256, 4 layers, 4 heads in 2 query groups, ffn 704,
vocabulary 8192, RoPE, SwiGLU, RMSNorm) and the same conversations on each side; tokens
counted are the conversations' own (padding excluded), so the figure is the speed-up
from not computing padding. Each side takes `--warmup` untimed steps, then the sides
alternate for `--steps` timed ones; best and median tokens/s. Target: packed >= 2x
padded at this length mix.

    uv run python ci/bench/bench_packed_sft.py [--seq 4096] [--mean 300] [--steps 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import numpy as np
import torch
from harness import context, emit

from mp_data import pack_conversations
from mp_layers import GPTModel, ModelGroups, PackedSeqParams, TransformerConfig

VOCAB = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mean", type=int, default=300, help="mean conversation length")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    steps = args.warmup + args.steps
    lengths = rng.integers(args.mean // 6, args.mean * 11 // 6 + 1, steps * args.seq // args.mean)
    conversations = [torch.from_numpy(rng.integers(1, VOCAB, n)) for n in lengths]
    bounds = pack_conversations(lengths, args.seq)  # the SFT data's packing
    batches = [conversations[a:b] for a, b in itertools.pairwise(bounds[: steps + 1])]
    sides = {name: Side(args.seq, way) for name, way in
             (("packed", "packed"), ("padded", "seq"), ("padded-longest", "longest"))}  # fmt: skip
    times = {name: [] for name in sides}
    for step, batch in enumerate(batches):
        order = list(sides.items()) if step % 2 == 0 else list(reversed(sides.items()))
        for name, side in order:
            start = time.perf_counter()
            side.train_step(batch)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    tokens = [sum(len(c) for c in b) for b in batches[args.warmup :]]
    figures = {"seq": args.seq, "mean_length": args.mean,
               "conversations_per_step": round(statistics.mean(len(b) for b in batches), 1),
               "real_tokens_per_step": round(statistics.mean(tokens))}  # fmt: skip
    for name in sides:
        rates = [t / s for t, s in zip(tokens, times[name], strict=True)]
        figures[f"{name}_tokens_per_s"] = round(max(rates), 1)
        figures[f"{name}_tokens_per_s_median"] = round(statistics.median(rates), 1)
    for name in ("padded", "padded-longest"):
        figures[f"speedup_over_{name}"] = round(
            figures["packed_tokens_per_s"] / figures[f"{name}_tokens_per_s"], 2
        )
        figures[f"speedup_over_{name}_median"] = round(
            figures["packed_tokens_per_s_median"] / figures[f"{name}_tokens_per_s_median"], 2
        )
    emit("packed_sft[bf16]", figures, context())


class Side:
    """One way of batching, with its own copy of the model and optimizer."""

    def __init__(self, seq: int, way: str) -> None:
        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=704, position_embedding_type="rope", normalization="RMSNorm",
            activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, untie_embeddings_and_output_weights=True,
        )  # fmt: skip
        self.model = GPTModel(config, "local", VOCAB, seq, groups=ModelGroups.single())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.seq, self.way = seq, way

    def train_step(self, conversations: list[torch.Tensor]) -> None:
        tokens, mask, packed = self._batch(conversations)
        labels = torch.roll(tokens, -1, dims=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(tokens, attention_mask=packed, labels=labels)
        (loss.float() * mask).sum().div(mask.sum()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _batch(self, conversations):
        if self.way == "packed":
            tokens = torch.zeros(1, self.seq, dtype=torch.long)
            ids = torch.full((1, self.seq), len(conversations))  # the tail: one more document
            mask = torch.zeros(1, self.seq)
            start = 0
            for i, c in enumerate(conversations):
                tokens[0, start : start + len(c)] = c
                ids[0, start : start + len(c)] = i
                mask[0, start : start + len(c) - 1] = 1  # the last token predicts nothing
                start += len(c)
            return tokens, mask, PackedSeqParams.from_document_ids(ids)
        length = self.seq if self.way == "seq" else max(len(c) for c in conversations)
        tokens = torch.zeros(len(conversations), length, dtype=torch.long)
        mask = torch.zeros(len(conversations), length)
        for i, c in enumerate(conversations):
            tokens[i, : len(c)] = c
            mask[i, : len(c) - 1] = 1
        return tokens, mask, None  # causal: each sample's padding follows its conversation


if __name__ == "__main__":
    main()
