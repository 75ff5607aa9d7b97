"""Gated DeltaNet layers (Qwen3-Next's linear attention; agreement with transformers:
tests/test_hf_families.py -k qwen3_next): the chunked delta rule against the recurrence
position by position (fp64, with and without an initial state) and over packed documents
against each document alone; a model with a gated DeltaNet layer over packed samples
against each document alone; TP2 (with and without sequence parallelism) against TP1,
the loss and every parameter's gradient after the finalize step's all-reduce of the marked
gradients (the norms shared by heads: the DeltaNet's out_norm, the softmax layer's
q/k_layernorm); generation through a KVCache, left-padded prompts
fed in pieces across a chunk edge, against the full forward; and the config's refusals."""

import functools

import pytest
import torch
import torch.nn.functional as F

import mp_state
from mp_ckpt import ShardedTensor, check_tiling
from mp_layers import (
    GPTModel,
    KVCache,
    ModelGroups,
    PackedSeqParams,
    TransformerConfig,
    all_reduce_sequence_parallel_grads,
)
from mp_layers.config_linear_attention import linear_attention_layer_pattern
from mp_layers.transformer.delta_rule import chunked_delta_rule, recurrent_delta_rule
from mp_layers.transformer.gated_delta_net import DELTA_CHUNK, GatedDeltaNet
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

VOCAB, MAX = 64, 160


def rule_inputs(s: int) -> tuple[torch.Tensor, ...]:
    """fp64 q, k (L2-normalized), v, g, beta and an initial state: 2 samples of s positions,
    3 heads, dk 4, dv 5; decays mild enough that states carry across documents."""
    gen = torch.Generator().manual_seed(0)
    b, h, dk, dv = 2, 3, 4, 5

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = draw(b, s, h, dk), F.normalize(draw(b, s, h, dk), dim=-1), draw(b, s, h, dv)
    g = -torch.rand(b, s, h, generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, draw(b, h, dk, dv)


def document_ids(ids: list[list[int]], lengths: list[list[int]]) -> torch.Tensor:
    """[b, s]: each sample's ids, each repeated over its run's length."""
    rows = zip(ids, lengths, strict=True)
    return torch.stack([torch.tensor(r).repeat_interleave(torch.tensor(n)) for r, n in rows])


@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_the_chunked_rule_is_the_recurrence(chunk, with_initial):
    """chunked_delta_rule's outputs and final state are the recurrence's within 1e-12 in fp64,
    over 23 positions (not a multiple of the chunk)."""
    q, k, v, g, beta, initial = rule_inputs(23)
    initial = initial if with_initial else None
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, initial)
    got, state = chunked_delta_rule(q, k, v, g, beta, chunk, initial)
    assert got.dtype == state.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 16, 32])
def test_the_chunked_rule_restarts_at_each_document(chunk):
    """With documents, each document's outputs are the recurrence over it alone, and the
    final state is the last document's; sample 1 reuses an id for two runs (two documents),
    which share a chunk of 32."""
    q, k, v, g, beta, _ = rule_inputs(23)
    lengths, ids = [[4, 1, 8, 10], [9, 7, 7]], [[7, 3, 9, 4], [5, 6, 5]]
    documents = document_ids(ids, lengths)
    got, final = chunked_delta_rule(q, k, v, g, beta, chunk, documents=documents)
    for i, sizes in enumerate(lengths):
        start = 0
        for size in sizes:
            piece = (slice(i, i + 1), slice(start, start + size))
            want, state = recurrent_delta_rule(*(x[piece] for x in (q, k, v, g, beta)))
            torch.testing.assert_close(got[piece], want, rtol=0, atol=1e-12)
            start += size
        torch.testing.assert_close(final[i : i + 1], state, rtol=0, atol=1e-12)
    whole, _ = chunked_delta_rule(q, k, v, g, beta, chunk)  # without: the state runs on
    assert (whole[0, 4:] - got[0, 4:]).abs().max() > 1e-2


def config(**settings) -> TransformerConfig:
    """Two layers: a gated DeltaNet (2 key heads of 8, 4 value heads of 8), then gated
    softmax attention with QK norms and half-rotated heads."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                kv_channels=8, ffn_hidden_size=48, experimental_attention_variant="gdn",
                linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, attention_output_gate=True,
                qk_layernorm=True, apply_layernorm_1p=True, normalization="RMSNorm",
                activation="swiglu", position_embedding_type="rope", rotary_percent=0.5,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    return TransformerConfig(**base | settings)


def small_model() -> GPTModel:
    """A one-rank model with its gated DeltaNet's decays made slow (A in [e^-3, 1]) and its
    weights wider (std 0.2), so that states carry far: mixing documents would show."""
    torch.manual_seed(0)
    model = GPTModel(config(init_method_std=0.2), "local", VOCAB, MAX, groups=ModelGroups.single())
    gdn = model.decoder.layers[0].self_attention
    assert isinstance(gdn, GatedDeltaNet)
    with torch.no_grad():
        gdn.A_log.uniform_(-3, 0, generator=torch.Generator().manual_seed(1))
    return model.eval()


def test_packed_documents_match_each_document_alone():
    """A GPTModel over packed samples of 150 positions (documents crossing the 64-position
    chunks' edges, sample 1 reusing an id for two runs) gives each document the logits, and
    every parameter the gradients, of running each document alone."""
    assert DELTA_CHUNK == 64
    model = small_model()
    lengths, ids = [[70, 3, 77], [40, 40, 70]], [[0, 1, 2], [5, 6, 5]]
    tokens = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(2))
    packed = PackedSeqParams.from_document_ids(document_ids(ids, lengths))
    logits = model(tokens, attention_mask=packed)
    model(tokens, attention_mask=packed, labels=tokens).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        mixed = model(tokens)  # unpacked, the documents see the ones before them
    assert (mixed[0, 73:] - logits[0, 73:]).abs().max() > 1e-3
    for i, sizes in enumerate(lengths):
        start = 0
        for size in sizes:
            doc = tokens[i : i + 1, start : start + size]
            alone = model(doc)
            got = logits[i : i + 1, start : start + size]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            model(doc, labels=doc).sum().backward()
            start += size
    for name, param in model.named_parameters():  # sums over 300 tokens: fp32 relative error
        scale = float(param.grad.abs().max())
        torch.testing.assert_close(
            packed_grads[name], param.grad, rtol=0, atol=1e-5 * scale, msg=name
        )


def test_cached_generation_equals_the_full_forward():
    """Two left-padded prompts (80 and 71 tokens) fed through a KVCache as 70 slots, then one
    slot at a time for 10 more (crossing the delta rule's 64-position chunk), give at every
    real position the logits of a full forward of each sequence alone."""
    model = small_model()
    sizes = (80, 71)
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen) for n in sizes]
    padding = torch.tensor([80 - n for n in sizes])
    batch = torch.stack([F.pad(seq, (80 - len(seq), 0)) for seq in sequences])
    cache = KVCache(padding, MAX, all_logits=True)
    with torch.no_grad():
        pieces = [model(batch[:, :70], kv_cache=cache)]
        pieces += [model(batch[:, t : t + 1], kv_cache=cache) for t in range(70, 80)]
        cached = torch.cat(pieces, dim=1)  # [b, 80, v]
        assert cache.length == 80
        for i, seq in enumerate(sequences):
            full = model(seq[None])[0]
            torch.testing.assert_close(cached[i, int(padding[i]) :], full, rtol=1e-5, atol=1e-5)


QK_NORMS = ("q_layernorm", "k_layernorm")


def grad_pieces(model: GPTModel) -> dict[str, ShardedTensor]:
    """The model's sharding description, laid over the gradients instead of the weights."""
    params = list(model.parameters())
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        described = model.sharded_state_dict().items()
        return {
            k: ShardedTensor(
                k, v.data.detach().clone(), v.global_shape, v.global_offset, v.replica_id
            )
            for k, v in described
        }
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def losses_and_grads(layouts: list[tuple[int, bool]]) -> list:
    torch.set_num_threads(1)
    results = []
    for tp, sequence_parallel in layouts:
        state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=tp))
        tracker = mp_state.set_random_seeds(1234, state)
        groups = ModelGroups.of(state)
        settings = config(sequence_parallel=sequence_parallel)
        model = GPTModel(settings, "local", VOCAB, MAX, groups=groups, rng_tracker=tracker)
        out_norm = model.decoder.layers[0].self_attention.out_norm.weight
        assert out_norm.sequence_parallel
        gen = torch.Generator().manual_seed(5)
        ids, labels = torch.randint(0, VOCAB, (2, 2, 72), generator=gen)  # crossing a chunk's edge
        loss = model(ids, labels=labels)
        loss.mean().backward()
        all_reduce_sequence_parallel_grads(model, state.tp)  # finalize_model_grads' step 2
        results.append((loss.detach(), grad_pieces(model)))
        mp_state.destroy()
    return results


LAYOUTS = [(1, False), (2, False), (2, True)]


@functools.cache
def tensor_parallel_runs() -> list:
    """Per rank, per layout of LAYOUTS: (loss, gradient pieces); run once per process."""
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))  # warm imports before forking
    return run_on_ranks(losses_and_grads, 2, LAYOUTS, timeout=120)


def differences(layout: int) -> dict[tuple[str, int], float]:
    """Per (key, rank): the largest difference of its gradient piece at LAYOUTS[layout] from
    TP1's; and ("loss", rank)."""
    per_rank = tensor_parallel_runs()
    reference_loss, reference = per_rank[0][0]
    tp = LAYOUTS[layout][0]
    check_tiling([p for rank in range(tp) for p in per_rank[rank][layout][1].values()])
    worst = {}
    for rank in range(tp):
        loss, pieces = per_rank[rank][layout]
        worst["loss", rank] = float((loss - reference_loss).abs().max())
        assert pieces.keys() == reference.keys()
        for key, piece in pieces.items():
            want = reference[key].data[piece.global_slices]
            scale = max(float(want.abs().max()), 1e-3)
            worst[key, rank] = float((piece.data - want).abs().max()) / scale
    return worst


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_equals_tp1(sequence_parallel):
    """At TP2 the loss and every parameter's gradient (each rank's piece, replicas too) are
    TP1's, the norms shared by heads split over the ranks (the gated DeltaNet's out_norm,
    the softmax layer's q/k_layernorm) after the all-reduce of marked gradients, with and
    without sequence parallelism."""
    worst = differences(LAYOUTS.index((2, sequence_parallel)))
    assert any(key.endswith("out_norm.weight") for key, _ in worst)
    assert sum(any(n in key for n in QK_NORMS) for key, _ in worst) == 4  # 2 norms x 2 ranks
    failing = {key: diff for key, diff in worst.items() if diff > 1e-5}
    assert not failing, failing


def test_the_config_refuses_what_it_cannot_build():
    """Each refusal names its field; "gated_delta_net" is normalized to "gdn"."""
    assert linear_attention_layer_pattern(config()) == [True, False]
    alias = config(experimental_attention_variant="gated_delta_net")
    assert alias.experimental_attention_variant == "gdn"
    refusals = [
        (dict(experimental_attention_variant=None), r"linear_attention_freq=2 needs"),
        (dict(linear_attention_freq=None), r"'gdn' needs linear_attention_freq"),
        (dict(experimental_attention_variant="gdn2"),
         r"experimental_attention_variant='gdn2' \(the gated DeltaNet-2 variant\)"),
        (dict(experimental_attention_variant="dsa"),  # DeepSeek's, for MLA layers
         r"linear_attention_freq=2 needs experimental_attention_variant='gdn'"),
        (dict(linear_num_value_heads=6, linear_num_key_heads=4),
         r"linear_num_key_heads=4 does not divide linear_num_value_heads=6"),
        (dict(linear_attention_freq=[1, 0, 1]), r"linear_attention_freq=\[1, 0, 1\] must be"),
    ]  # fmt: skip
    for settings, message in refusals:
        with pytest.raises(ValueError, match=message):
            config(**settings)
    odd = config(linear_num_key_heads=3, linear_num_value_heads=6)
    message = r"linear_num_key_heads=3 is not divisible by tensor_model_parallel_size=2"
    with pytest.raises(ValueError, match=message):
        odd.check_parallel(2)
    config().check_parallel(2, 1)  # (context parallelism: test_gated_delta_net_cp.py)
