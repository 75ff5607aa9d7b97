"""Generation from a KVCache equals recomputing every position: a batch of prompts of
different lengths (left-padded), a prefill, then one position at a time, gives at every
step each sequence's logits of a full forward of that sequence alone; with rotary
(grouped-query attention), learned position embeddings, multi-latent attention
(whose cache holds latents; attention over them against the heads' keys of the full
forward), Llama 4's attention (chunked, with NoPE layers and their query temperature:
the cache's block mask against the full forward's blocks) and a Mamba-hybrid model (the
cache holding each Mamba layer's states), at TP1 and TP2 (with one key/value head at
TP2 too: a group shared by both ranks). The latent
cache's bytes per position and layer are r + dr elements."""

import pytest
import torch

from mp_layers import GPTModel, KVCache, ModelGroups, TransformerConfig
from mp_state.testing import run_on_ranks

VOCAB, MAX = 64, 40
STYLES = {
    "llama-gqa": dict(num_attention_heads=4, num_query_groups=2, kv_channels=8,
                      ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
                      position_embedding_type="rope", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True),
    "gpt2": dict(num_attention_heads=4),
    # one key/value head: at TP2 each rank holds half its rows and gathers the other half
    "mqa": dict(num_attention_heads=4, num_query_groups=1, kv_channels=8,
                position_embedding_type="rope", add_bias_linear=False),
    "mla": dict(num_attention_heads=4, multi_latent_attention=True, q_lora_rank=16,
                kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
                yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
                yarn_mscale_all_dim=0.9, add_bias_linear=False),
    # Llama 4: layer 1 without rotary embeddings, its queries scaled from position 2 on;
    # layer 0 rotating interleaved pairs with L2-normalized queries and keys, attending
    # within blocks of 4 positions (the prompts and the steps cross several)
    "llama4": dict(num_attention_heads=4, num_query_groups=2, kv_channels=8,
                   ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
                   position_embedding_type="rope", add_bias_linear=False,
                   rotary_interleaved=True, no_rope_freq=2, qk_l2_norm=True,
                   qk_l2_norm_layers="rope", attention_chunk_size=4,
                   attn_temperature_floor_scale=3, attn_temperature_scale=0.5),
    # A Mamba-hybrid model: a Mamba-2 layer (its convolution's inputs and scan state in the
    # cache; padding leaves them untouched), then attention
    "hybrid": dict(num_attention_heads=4, num_query_groups=2, kv_channels=8,
                   normalization="RMSNorm", position_embedding_type="none",
                   add_bias_linear=False, hybrid_layer_pattern="M*", mamba_num_heads=8,
                   mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16),
}  # fmt: skip


def model(style: str, groups: ModelGroups) -> GPTModel:
    config = TransformerConfig(num_layers=2, hidden_size=32, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.2,
                               **STYLES[style])  # fmt: skip
    torch.manual_seed(0)
    return GPTModel(config, "local", VOCAB, MAX, groups=groups, parallel_output=False,
                    init_seed=1).eval()  # fmt: skip


def check_cached_equals_recomputed(style: str, groups: ModelGroups) -> float:
    gpt = model(style, groups)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (5, 9, 1)]
    longest = max(map(len, prompts))
    padding = torch.tensor([longest - len(p) for p in prompts])
    batch = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    cache = KVCache(padding, MAX)
    worst = 0.0
    sequences = [list(p) for p in prompts]
    with torch.no_grad():
        step_input = batch
        for _ in range(6):
            logits = gpt(step_input, kv_cache=cache)[:, -1]  # [b, v]
            for i, sequence in enumerate(sequences):
                alone = gpt(torch.tensor([sequence]))[0, -1]
                worst = max(worst, float((logits[i] - alone).abs().max()))
            new = logits.argmax(-1)
            for sequence, token in zip(sequences, new.tolist(), strict=True):
                sequence.append(token)
            step_input = new[:, None]
    assert cache.length == longest + 5  # the prompts, then five one-position steps
    if gpt.config.multi_latent_attention:  # the latent and the rotated key, per position
        width = gpt.config.kv_lora_rank + gpt.config.qk_pos_emb_head_dim
        assert cache.layer_bytes(0) == len(prompts) * MAX * width * 4
    return worst


@pytest.mark.parametrize("style", sorted(STYLES))
def test_cached_generation_equals_recomputing(style):
    assert check_cached_equals_recomputed(style, ModelGroups.single()) < 1e-5


def tp_body() -> dict[str, float]:
    import mp_state

    torch.set_num_threads(1)
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
    return {style: check_cached_equals_recomputed(style, ModelGroups.of(state))
            for style in ("llama-gqa", "mqa", "mla", "llama4", "hybrid")}  # fmt: skip


@pytest.mark.multirank
def test_cached_generation_equals_recomputing_at_tp2():
    for worst in run_on_ranks(tp_body, 2, timeout=120):
        assert max(worst.values()) < 1e-5, worst


def test_the_cache_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="leaves no room in max_length=4"):
        KVCache(torch.tensor([4, 0]), 4)
    cache = KVCache(torch.tensor([0]), 4)
    gpt = model("gpt2", ModelGroups.single())
    with torch.no_grad(), pytest.raises(ValueError, match="5 more positions after 0 exceed"):
        gpt(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
