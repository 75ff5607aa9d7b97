"""Packed sequences: documents of lengths 1, 7, 64 and 200 packed into 512 positions (the rest
one more document of padding) give every document the logits and every parameter the
gradients of running each document alone (fp32, 1e-5), with grouped-query attention, RoPE
(positions restart per document, Ministral 3's query scaling by position too), SDPA and the
blocked path, a learnable softmax offset and a sliding window, and selective and full
recompute; a multi-token prediction layer's loss over packed documents is each document's
alone, pooled. Memory of packed attention at 16,384 positions:
ci/bench/bench_packed_attention.py."""

import pytest
import torch

from mp_layers import GPTModel, ModelGroups, PackedSeqParams, TransformerConfig

LENGTHS = (1, 7, 64, 200)
SEQ, VOCAB = 512, 128

VARIANTS = {
    "sdpa": {},
    "blocked": {"attention_backend": "local"},
    "sinks-window": {"softmax_type": "learnable", "window_size": (16, 0)},
    # Ministral 3's query scaling, its steps of 16 positions counted within each document
    "query-log-scale": {"query_log_scale_beta": 0.5, "query_log_scale_length": 16},
    "recompute": {"recompute_granularity": "selective"},
    "full-recompute": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}


def model_of(**extra) -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
        ffn_hidden_size=64, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        **extra,
    )  # fmt: skip
    return GPTModel(config, "local", VOCAB, SEQ, groups=ModelGroups.single())


def grads_of(model: GPTModel) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_documents_match_each_document_alone(variant):
    model = model_of(**VARIANTS[variant])
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (1, n), generator=generator) for n in LENGTHS]
    pad = SEQ - sum(LENGTHS)
    tokens = torch.cat([*docs, torch.zeros(1, pad, dtype=torch.long)], dim=1)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate((*LENGTHS, pad))])[None]
    packed = PackedSeqParams.from_document_ids(ids)
    assert packed.segments == [[(0, 1), (1, 8), (8, 72), (72, 272), (272, 512)]]

    logits = model(tokens, attention_mask=packed)  # [1, s, v]
    per_token = model(tokens, attention_mask=packed, labels=tokens)
    per_token[:, : sum(LENGTHS)].sum().backward()
    packed_grads = grads_of(model)

    start = 0
    for doc in docs:
        n = doc.shape[1]
        alone = model(doc)
        torch.testing.assert_close(logits[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        model(doc, labels=doc).sum().backward()
        start += n
    alone_grads = grads_of(model)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_documents_are_runs_of_equal_ids():
    packed = PackedSeqParams.from_document_ids(torch.tensor([[3, 3, 7, 7, 7, 3], [0] * 6]))
    assert packed.segments == [[(0, 2), (2, 5), (5, 6)], [(0, 6)]]
    assert packed.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 6, 12]


def test_multi_token_prediction_stays_within_each_document():
    """The MTP loss of packed documents is the one of each document alone, pooled: no
    position predicts a token of the next document."""
    model = model_of(mtp_num_layers=1)
    generator = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (1, n), generator=generator) for n in LENGTHS]
    tokens = torch.cat(docs, dim=1)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    model(tokens, attention_mask=PackedSeqParams.from_document_ids(ids), labels=tokens)
    packed = float(model.mtp.take_losses()[0])
    totals, counts = 0.0, 0
    for doc in docs:
        model(doc, labels=doc)
        count = doc.shape[1] - 1  # the last position's rolled token is past the document
        totals += float(model.mtp.take_losses()[0]) * count  # the mean times its count
        counts += count
    assert packed == pytest.approx(totals / counts, rel=1e-5)


@pytest.mark.cuda
def test_packed_attention_on_cuda_matches_each_document_alone():
    """On a GPU in bf16 (the variable-length flash kernel where torch has one, else one
    document at a time): outputs and input gradients equal fp32 attention over each
    document alone, within bf16's rounding."""
    import torch.nn.functional as F

    from mp_layers.transformer.core_attention import CoreAttention

    torch.manual_seed(0)
    s, nq, ng, d = 512, 8, 2, 64
    q, k, v = (torch.randn(s, 2, n, d, device="cuda") for n in (nq, ng, ng))
    grad = torch.randn(s, 2, nq * d, device="cuda")
    lengths = [[1, 7, 64, 200, 240], [300, 212]]
    ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                       for row in lengths]).cuda()  # fmt: skip
    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = CoreAttention(0.0, None, "auto")(*inputs, PackedSeqParams.from_document_ids(ids))
    out.backward(grad.bfloat16())
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    pieces = []
    for sample, row in enumerate(lengths):
        start, parts = 0, []
        for n in row:
            part = [t[start : start + n, sample].permute(1, 0, 2) for t in reference]
            o = F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)
            parts.append(o.permute(1, 0, 2).reshape(n, nq * d))
            start += n
        pieces.append(torch.cat(parts))
    expected = torch.stack(pieces, dim=1)
    expected.backward(grad)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=3e-2)
    for got, want in zip(inputs, reference, strict=True):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=0, atol=5e-2)
