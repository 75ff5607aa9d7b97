"""Attention sinks (softmax_type) and sliding windows (window_size) against the written-out
formula, on every path: banded (SDPA's place; its CPU flash kernel and its matmul kernel),
blocked, an explicit mask, cached generation; which layers take the window; what the
configuration refuses."""

import math
from dataclasses import replace

import pytest
import torch

from mp_layers import GPTModel, KVCache, ModelGroups, TransformerConfig
from mp_layers.config_attention import window_layer_pattern
from mp_layers.context_parallel import block_math
from mp_layers.transformer.banded_attention import banded_attention
from mp_layers.transformer.core_attention import CoreAttention


def by_formula(q, k, v, *, window=None, sink=None, mask=None):
    """softmax over [scores, sink] with the causal (and window, and given) mask, in fp64."""
    s, b, nq, d = q.shape
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(nq // k.shape[2], dim=2)
    v = v.repeat_interleave(nq // v.shape[2], dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    masked = (j > i) if mask is None else mask
    if window is not None:
        masked = masked | (j < i - window)
    scores = scores.masked_fill(masked, float("-inf"))
    if sink is not None:
        column = sink.double().view(1, nq, 1, 1).expand(b, nq, s, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, nq * d)


def outputs_and_grads(fn, q, k, v, sink):
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        sink = sink.detach().requires_grad_()
    out = fn(*inputs, sink)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    grads = [t.grad for t in inputs] + ([sink.grad] if sink is not None else [])
    return [out.float()] + [g.float() for g in grads]


def inputs(s=37, groups=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(s, 2, 4, 8, generator=generator)
    k, v = (torch.randn(s, 2, groups, 8, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(4, generator=generator)


def check(fn, q, k, v, sink, **formula):
    want = outputs_and_grads(lambda q, k, v, z: by_formula(q, k, v, sink=z, **formula), q, k, v,
                             sink)  # fmt: skip
    got = outputs_and_grads(fn, q, k, v, sink)
    assert len(got) == len(want)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want, strict=False):
        torch.testing.assert_close(g, w.float(), rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("kernel", ["cpu-flash", "matmul"])
@pytest.mark.parametrize("window", [None, 0, 5, 40])
@pytest.mark.parametrize("sinks", [None, "off-by-one", "learnable"])
def test_banded_attention_equals_the_formula(kernel, window, sinks, monkeypatch):
    if kernel == "matmul":  # the kernel of devices without the CPU flash one
        monkeypatch.setattr(block_math, "_flash", lambda q: False)
    q, k, v, sink = inputs()
    if sinks is None:
        sink = None
    elif sinks == "off-by-one":
        sink = torch.zeros(4)

    def fn(q, k, v, z):
        return banded_attention(q, k, v, scale=8**-0.5, window=window, sink=z, block=16)

    check(fn, q, k, v, sink, window=window)


@pytest.mark.parametrize("backend", ["flash", "local", "auto"])
@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize(("sinks", "window"), [("learnable", None), ("off-by-one", 6),
                                               ("learnable", 6), ("vanilla", 6)])  # fmt: skip
def test_core_attention_with_sinks_and_windows_equals_the_formula(backend, groups, sinks, window):
    """ "auto" takes the blocked path at this size, "flash" the banded one."""
    q, k, v, sink = inputs(groups=groups)
    attention = CoreAttention(0.0, None, backend, softmax_type=sinks, window=window, heads=4)
    if sinks == "learnable":
        with torch.no_grad():
            attention.softmax_offset.copy_(sink)

    got = outputs_and_grads(lambda q, k, v, z: attention(q, k, v), q, k, v, None)
    if sinks == "learnable":
        got.append(attention.softmax_offset.grad)
    fixed = {"off-by-one": torch.zeros(4), "vanilla": None}.get(sinks, sink)
    want = outputs_and_grads(lambda q, k, v, z: by_formula(q, k, v, sink=z, window=window), q, k,
                             v, fixed)  # fmt: skip
    if sinks != "learnable" and fixed is not None:
        want.pop()  # the fixed sink has no gradient to compare
    assert len(got) == len(want)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("backend", ["flash", "local"])
def test_an_explicit_mask_with_a_window_and_sinks_takes_the_blocked_path(backend):
    q, k, v, sink = inputs(s=12)
    document = (torch.arange(12) >= 5).long()
    allowed = torch.ones(12, 12, dtype=torch.bool).tril() & (document[:, None] == document[None])
    mask = (~allowed)[None, None]
    attention = CoreAttention(0.0, None, backend, softmax_type="learnable", window=3, heads=4)
    with torch.no_grad():
        attention.softmax_offset.copy_(sink)
    want = by_formula(q, k, v, window=3, sink=sink, mask=mask).float()
    torch.testing.assert_close(attention(q, k, v, mask), want, rtol=2e-5, atol=2e-5)


def config(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4)
    return TransformerConfig(**(base | kw))


def test_window_attn_skip_freq_picks_the_full_attention_layers_as_megatron_and_gpt_oss():
    # Megatron's is_layer_window_attention on 1-based layer numbers: n % N != 0 is windowed.
    assert window_layer_pattern(config(window_size=(127, 0), window_attn_skip_freq=2)) == [
        True, False, True, False,
    ]  # fmt: skip
    # gpt-oss: layer_types alternate sliding_attention (layer 0), full_attention (layer 1).
    from transformers import GptOssConfig

    hf = GptOssConfig(num_hidden_layers=4)
    assert [t == "sliding_attention" for t in hf.layer_types] == [True, False, True, False]
    assert window_layer_pattern(config(window_size=(7, 0), window_attn_skip_freq=3)) == [
        True, True, False, True,
    ]  # fmt: skip
    assert window_layer_pattern(config(window_size=(7, 0), window_attn_skip_freq=[0, 1, 1, 0])) == [
        False, True, True, False,
    ]  # fmt: skip
    assert window_layer_pattern(config(window_size=(7, 0))) == [True] * 4
    assert window_layer_pattern(config()) == [False] * 4


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(window_size=(127, 1)), r"window_size=\(127, 1\): right=1 .* right must be 0"),
        (dict(window_size=(-1, 0)), r"left=-1 must be >= 0"),
        (dict(window_size=(1, 2, 3)), r"must be two integers"),
        (dict(window_attn_skip_freq=2), r"window_attn_skip_freq=2 needs window_size"),
        (dict(window_size=(3, 0), window_attn_skip_freq=[1, 0]), r"4 values \(num_layers\)"),
        (dict(window_size=(3, 0), window_attn_skip_freq=0), r"window_attn_skip_freq=0 must be"),
        (dict(softmax_type="sigmoid"), r"softmax_type='sigmoid' must be one of"),
        (dict(yarn_beta_fast=16.0), r"yarn_beta_fast=16.0 needs position_embedding_type='yarn'"),
        (dict(position_embedding_type="yarn", rotary_percent=0.5), r"rotary_percent=0.5 with"),
        (dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=0.5), r"must be >= 1"),
    ],
)
def test_the_configuration_refuses_what_it_cannot_run(kw, message):
    with pytest.raises(ValueError, match=message):
        config(**kw)


def test_every_context_parallel_comm_type_takes_sinks_and_windows():
    """All of them attend with them (test_attention_variants_parallel.py)."""
    for comm_type, cp in (("a2a", 2), ("p2p", 2), ("all_gather", 2), ("a2a+p2p", 4)):
        config(window_size=(3, 0), softmax_type="learnable", cp_comm_type=comm_type,
               attention_dropout=0.0).check_parallel(1, cp)  # fmt: skip


VOCAB, MAX = 64, 40


def gpt_oss_like(max_length: int = MAX) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=16, add_bias_linear=False, add_qkv_bias=True,
        softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=2,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
    )  # fmt: skip
    return GPTModel(cfg, "local", VOCAB, max_length, groups=ModelGroups.single(),
                    parallel_output=False, init_seed=1).eval()  # fmt: skip


def test_cached_generation_with_windows_and_sinks_equals_recomputing():
    """A KVCache of left-padded prompts, window 3 on every other layer, learnable sinks,
    YaRN: each step's logits are those of a full forward of the sequence alone."""
    gpt = gpt_oss_like()
    cfg = gpt.config
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (6, 9, 1)]
    longest = max(map(len, prompts))
    padding = torch.tensor([longest - len(p) for p in prompts])
    cache = KVCache(padding, MAX)
    step_input = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    worst = 0.0
    with torch.no_grad():
        for _ in range(8):
            logits = gpt(step_input, kv_cache=cache)[:, -1]
            for i, sequence in enumerate(prompts):
                alone = gpt(torch.tensor([sequence]))[0, -1]
                worst = max(worst, float((logits[i] - alone).abs().max()))
            new = logits.argmax(-1)
            for sequence, token in zip(prompts, new.tolist(), strict=True):
                sequence.append(token)
            step_input = new[:, None]
    assert worst < 1e-5
    # The sequences outgrew the window: without it the same weights give other logits.
    unwindowed = replace(cfg, window_size=None, window_attn_skip_freq=None)
    full = GPTModel(unwindowed, "local", VOCAB, MAX, groups=ModelGroups.single(),
                    parallel_output=False, init_seed=1).eval()  # fmt: skip
    full.load_state_dict(gpt.state_dict())
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        assert not torch.allclose(full(ids), gpt(ids), atol=1e-3)


@pytest.mark.parametrize("backend", ["flash", "local"])
def test_selective_recompute_keeps_the_sinks_gradient(backend):
    def grads(granularity):
        cfg = config(num_layers=2, num_query_groups=2, softmax_type="learnable",
                     window_size=(3, 0), window_attn_skip_freq=2, hidden_dropout=0.0,
                     attention_dropout=0.0, recompute_granularity=granularity,
                     attention_backend=backend)  # fmt: skip
        model = GPTModel(cfg, "local", VOCAB, 16, groups=ModelGroups.single(), init_seed=1)
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).mean().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, recomputed = grads(None), grads("selective")
    assert plain["decoder.layers.0.self_attention.core_attention.softmax_offset"].abs().sum() > 0
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, msg=name)


def test_a_windowed_layer_keeps_a_ring_of_key_block_slots_past_it():
    """Window 3 keeps a ring of 64 slots (KEY_BLOCK) in layer 0 while the sequences grow
    past them (from slot 64 on, new keys overwrite the oldest); full layer 1 keeps all 80
    slots; the logits stay those of full forwards."""
    gpt = gpt_oss_like(max_length=80)
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (62, 60)]
    cache = KVCache(torch.tensor([0, 2]), 80)
    step_input = torch.tensor([sequences[0], [0, 0, *sequences[1]]])
    per_slot = 2 * 2 * 2 * 8 * 4  # keys and values, b 2, 2 key/value heads, d 8, fp32
    with torch.no_grad():
        for _ in range(8):
            logits = gpt(step_input, kv_cache=cache)[:, -1]
            assert cache.layer_bytes(0) == 64 * per_slot
            assert cache.layer_bytes(1) == 80 * per_slot
            for i, sequence in enumerate(sequences):
                alone = gpt(torch.tensor([sequence]))[0, -1]
                torch.testing.assert_close(logits[i], alone, rtol=1e-5, atol=1e-5)
            new = logits.argmax(-1)
            for sequence, token in zip(sequences, new.tolist(), strict=True):
                sequence.append(token)
            step_input = new[:, None]
    assert cache.length == 69
