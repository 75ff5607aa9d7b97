"""chunked_linear_cross_entropy against today's output layer + vocab_parallel_cross_entropy.

Shapes: hidden [s, b, h] (or [s/tp, b, h] under sequence parallelism), weight
[v/tp, h], targets and loss [s, b]. Chunks of 7 tokens over s * b = 32, so the
last chunk is short; the loss and the gradients of the hidden states and of the
weight must equal the unchunked path's in fp32, at TP 1, TP 2 and TP 2 with
sequence parallelism, with and without label smoothing.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    chunked_linear_cross_entropy,
    vocab_parallel_cross_entropy,
)
from mp_state.testing import run_on_ranks

S, B, H, V, CHUNK = 16, 2, 32, 250, 7
ONE_RANK = mp_state.RankGroup("tp", (0,), 0, None)
FP32 = {"rtol": 1e-5, "atol": 1e-6}

# assert_close imports sympy on first use: once here, not in every forked rank.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small gain nothing from a second thread, and on a loaded machine each
    matmul's thread barrier can cost milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    target = torch.randint(0, V, (S, B), generator=gen)
    grad = torch.rand(S, B, generator=gen)
    return hidden, weight, target, grad


def both_paths(hidden, weight, target, grad, group, smoothing, layer=None, **kw):
    """(loss, hidden grad, weight grad) of the unchunked and of the chunked path."""
    results = []
    for chunked in (False, True):
        x = hidden.detach().clone().requires_grad_()
        if layer is None:
            w = weight.detach().clone().requires_grad_()
            total = x
        else:
            w = layer.weight
            w.grad = None
            total = layer.matmul_input(x)
        if chunked:
            loss = chunked_linear_cross_entropy(total, w, target, group, CHUNK, smoothing, **kw)
        else:
            logits = layer(x)[0] if layer is not None else F.linear(x, w)
            loss = vocab_parallel_cross_entropy(logits, target, group, smoothing,
                                                grad_in_logits=True)  # fmt: skip
        loss.backward(grad)
        results.append((loss.detach(), x.grad, w.grad.clone()))
    return results


def check_equal(results, what, tolerance=FP32):
    (ref_loss, ref_x, ref_w), (loss, x, w) = results
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape, what
    for name, a, b in (
        ("loss", loss, ref_loss),
        ("hidden grad", x, ref_x),
        ("weight grad", w, ref_w),
    ):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"{what}: {name}: {m}")  # noqa: B023


def test_one_rank_equals_the_unchunked_loss_in_fp32_bf16_and_under_autocast():
    hidden, weight, target, grad = inputs()
    for smoothing in (0.0, 0.1):
        check_equal(both_paths(hidden, weight, target, grad, ONE_RANK, smoothing),
                    f"fp32 label_smoothing={smoothing}")  # fmt: skip
    # bf16 weights: the gradient over the 5 chunks accumulates in bf16 (one rounding each).
    bf16 = both_paths(hidden.bfloat16(), weight.bfloat16(), target, grad, ONE_RANK, 0.0)
    assert bf16[1][1].dtype == bf16[1][2].dtype == torch.bfloat16
    check_equal(bf16, "bf16", {"rtol": 2e-2, "atol": 2e-2})
    # fp32 weights under bf16 autocast: the matmuls in bf16, the gradients returned in fp32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = both_paths(hidden, weight, target, grad, ONE_RANK, 0.0)
    assert mixed[1][1].dtype == mixed[1][2].dtype == torch.float32
    check_equal(mixed, "autocast", {"rtol": 2e-2, "atol": 2e-2})
    with torch.no_grad():  # evaluation: no gradient kept
        loss = chunked_linear_cross_entropy(hidden, weight, target, ONE_RANK, CHUNK)
    torch.testing.assert_close(loss, both_paths(hidden, weight, target, grad, ONE_RANK, 0.0)[0][0],
                               **FP32)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_tokens=0 must be a positive integer"):
        chunked_linear_cross_entropy(hidden, weight, target, ONE_RANK, 0)


def check_two_ranks():
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
    g, r = state.tp, state.tp.rank
    hidden, _, target, grad = inputs(1)
    for sp in (False, True):
        mp_state.set_random_seeds(7, state)
        layer = ColumnParallelLinear(H, V, tp_group=g, bias=False, sequence_parallel=sp,
                                     init_method=torch.nn.init.normal_)  # fmt: skip
        local = hidden.chunk(2, dim=0)[r] if sp else hidden
        for smoothing in (0.0, 0.1):
            results = both_paths(local, None, target, grad, g, smoothing, layer=layer)
            check_equal(results, f"tp=2 rank={r} sequence_parallel={sp} smoothing={smoothing}")
            # The chunked loss is the same on both ranks (the collectives combined them).
            other = results[1][0].clone()
            dist.broadcast(other, src=g.ranks[0], group=g.group)
            torch.testing.assert_close(results[1][0], other, rtol=0, atol=0)
    mp_state.destroy()


@pytest.mark.multirank
def test_two_ranks_with_and_without_sequence_parallelism_equal_the_unchunked_loss():
    run_on_ranks(check_two_ranks, 2, timeout=60)


def test_gpt_model_gives_the_same_loss_and_gradients_with_chunks():
    """Tied embeddings: the output weight is the word embedding, and both uses reach its
    gradient. Without labels the logits are unchanged."""
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    results = []
    for chunk in (0, CHUNK):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   output_loss_chunk_tokens=chunk)  # fmt: skip
        model = GPTModel(config, "local", V, S, groups=ModelGroups.single())
        assert model.output_layer.weight is model.embedding.weight
        loss = model(ids, labels=ids.roll(-1, dims=1))
        loss.mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, model(ids).detach()))
    (ref_loss, ref_grads, ref_logits), (loss, grads, logits) = results
    assert loss.shape == (B, S)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **FP32, msg=lambda m: f"{name}: {m}")  # noqa: B023
