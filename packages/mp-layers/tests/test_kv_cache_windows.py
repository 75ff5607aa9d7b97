"""A sliding-window layer keeps a ring of its window's latest keys in the KVCache: cached
generation (fp32, every position's logits, KVCache.all_logits) equals full forwards of
each sequence alone for prompts shorter and longer than the window, left-padded batches,
one or several new positions a call, windowed and full layers mixed, with and without
sinks, and through two pipeline stages with a cache each; the ring's bytes do not grow
with max_length while a full layer's do.

Most cases shrink KEY_BLOCK to 4 so that the rings (window + 1 slots rounded up to it)
wrap many times within short sequences; test_attention_sinks_windows.py runs the real
block size past 64 slots."""

import pytest
import torch

from mp_layers import GPTModel, KVCache, ModelGroups, TransformerConfig
from mp_layers.transformer import kv_cache as kv_cache_module
from mp_layers.transformer.kv_cache import ring_slots

VOCAB = 64


def gpt_oss_like(window: int, skip_freq, *, layers: int = 3, softmax_type: str = "learnable",
                 max_length: int = 128, **stage) -> GPTModel:  # fmt: skip
    """gpt-oss's attention at toy size (GQA, q/k/v biases, YaRN, sinks); `stage`: the
    pipeline-stage arguments of GPTModel (the same init_seed gives the same weights)."""
    config = TransformerConfig(
        num_layers=layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=16, add_bias_linear=False, add_qkv_bias=True,
        softmax_type=softmax_type, window_size=(window, 0), window_attn_skip_freq=skip_freq,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
        untie_embeddings_and_output_weights=True,
    )  # fmt: skip
    return GPTModel(config, "local", VOCAB, max_length, groups=ModelGroups.single(),
                    parallel_output=False, init_seed=1, **stage).eval()  # fmt: skip


def through(stages: list[GPTModel], ids: torch.Tensor, caches=None) -> torch.Tensor:
    """The logits of ids [b, s] through the stages in turn (a pipeline on one process)."""
    caches = caches or [None] * len(stages)
    hidden = None
    for stage, cache in zip(stages, caches, strict=True):
        hidden = stage(ids if stage.pre_process else None, decoder_input=hidden, kv_cache=cache)
    return hidden


def worst_difference(stages: list[GPTModel], lengths: list[int], chunks: list[int]) -> float:
    """The prompts (random, of `lengths`, left-padded), then `chunks` new positions a call
    through cached stages: the largest difference between a real position's logits and
    those of a full forward of its sequence alone."""
    generator = torch.Generator().manual_seed(0)
    grown = [torch.randint(0, VOCAB, (n + sum(chunks),), generator=generator) for n in lengths]
    longest = max(lengths)
    padding = torch.tensor([longest - n for n in lengths])
    padded = torch.stack([torch.cat([torch.zeros(int(p), dtype=torch.long), seq])
                          for p, seq in zip(padding, grown, strict=True)])  # fmt: skip
    caches = [KVCache(padding, padded.shape[1], all_logits=True) for _ in stages]
    with torch.no_grad():
        steps, start = [], 0
        for s in (longest, *chunks):
            steps.append(through(stages, padded[:, start : start + s], caches))
            start += s
        cached = torch.cat(steps, dim=1)  # [b, slots, v]
        worst = 0.0
        for i, sequence in enumerate(grown):
            alone = through(stages, sequence[None])[0]
            worst = max(worst, float((cached[i, int(padding[i]) :] - alone).abs().max()))
    return worst


@pytest.fixture
def small_blocks(monkeypatch):
    """KEY_BLOCK 4: rings of 4 slots for window 3, 8 for window 5."""
    monkeypatch.setattr(kv_cache_module, "KEY_BLOCK", 4)


@pytest.mark.parametrize("skip_freq", [2, [0, 1, 1], None], ids=["alternate", "list", "all"])
@pytest.mark.parametrize("chunks", [[1] * 8, [3, 1, 4, 2, 9, 1]], ids=["ones", "chunks"])
@pytest.mark.parametrize("lengths", [[2, 3, 1], [9, 13, 6]], ids=["short", "long"])
@pytest.mark.parametrize("window", [3, 5])
def test_cached_generation_through_rings_equals_full_forwards(
    small_blocks, window, lengths, chunks, skip_freq
):
    gpt = gpt_oss_like(window, skip_freq)
    assert worst_difference([gpt], lengths, chunks) < 1e-5


@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one"])
def test_rings_without_learnable_sinks(small_blocks, softmax_type):
    gpt = gpt_oss_like(3, 2, softmax_type=softmax_type)
    assert worst_difference([gpt], [7, 2, 4], [1, 2, 1, 5, 1]) < 1e-5


def test_two_pipeline_stages_with_a_cache_each(small_blocks):
    """Layers 0-1 and 2-3 as two stages (global layer numbers pick the windowed ones)."""
    whole = gpt_oss_like(3, 2, layers=4)
    stages = [
        gpt_oss_like(3, 2, layers=4, post_process=False, num_layers=2),
        gpt_oss_like(3, 2, layers=4, pre_process=False, layer_offset=2, num_layers=2),
    ]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(through(stages, ids), whole(ids), rtol=0, atol=1e-6)
    assert worst_difference(stages, [9, 4], [1, 1, 3, 1, 1]) < 1e-5


def test_ring_entries_hold_the_latest_slots():
    assert (ring_slots(0, 4) < 0).all()
    assert ring_slots(3, 4)[:3].tolist() == [0, 1, 2] and ring_slots(3, 4)[3] < 0
    assert ring_slots(6, 4).tolist() == [4, 5, 2, 3]
    assert ring_slots(8, 4).tolist() == [4, 5, 6, 7]


def test_a_windowed_layer_holds_its_ring_whatever_max_length():
    """Measured storage: window 3 keeps 64 slots (window + 1 rounded up to KEY_BLOCK) in
    layers 0 and 2; full layer 1 keeps max_length slots."""
    gpt = gpt_oss_like(3, 2, max_length=4096)
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(2))
    per_slot = 2 * 2 * 2 * 8 * 4  # keys and values, b 2, 2 key/value heads, d 8, fp32
    held = {}
    for max_length in (80, 1024, 4096):
        cache = KVCache(torch.tensor([3, 0]), max_length)
        with torch.no_grad():
            gpt(ids[:, :60], kv_cache=cache)
            for t in range(60, 70):
                gpt(ids[:, t : t + 1], kv_cache=cache)
        held[max_length] = [cache.layer_bytes(layer) for layer in range(3)]
    for max_length, (first, full, last) in held.items():
        assert first == last == 64 * per_slot
        assert full == max_length * per_slot
