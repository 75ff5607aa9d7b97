"""Vocabulary-parallel embedding and cross entropy against torch at TP 1, 2, 4.

Shapes: [s, b] ids and targets, [s, b, h] embeddings, [s, b, v/tp] logits.
Every rank builds the same full tensors and checks its piece of the
single-process result, gradients included (fp32, RTOL / ATOL below).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mp_state
from mp_layers.tensor_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

# assert_close imports sympy on first use (about 2 s): once here, in the
# parent, rather than in every forked rank.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

RTOL, ATOL = 1e-5, 1e-5
S, B, V, H = 8, 2, 16, 6


def close(actual, expected, what, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_embedding(tp: int):
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    g, r = state.tp, state.tp.rank
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (S, B), generator=gen)
    grad = torch.randn(S, B, H, generator=gen)
    for sp in (False, True):
        case = f"tp={tp} sequence_parallel={sp}"
        mp_state.set_random_seeds(99, state)
        layer = VocabParallelEmbedding(
            V, H, tp_group=g, init_method=torch.nn.init.normal_, sequence_parallel=sp
        )
        pieces = [torch.empty_like(layer.weight) for _ in range(tp)]
        dist.all_gather(pieces, layer.weight.detach(), group=g.group)
        reference = torch.nn.Embedding(V, H)
        with torch.no_grad():
            reference.weight.copy_(torch.cat(pieces))
        y_ref = reference(ids)
        y_ref.backward(grad)

        y = layer(ids)
        if sp:
            close(y, y_ref.detach().chunk(tp, dim=0)[r], f"{case}: output")
            y.backward(grad.chunk(tp, dim=0)[r])
        else:
            close(y, y_ref.detach(), f"{case}: output")
            y.backward(grad)
        close(layer.weight.grad, reference.weight.grad.chunk(tp)[r], f"{case}: weight grad")
    mp_state.destroy()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_equals_nn_embedding(tp):
    run_on_ranks(check_embedding, tp, tp, timeout=60)


def check_cross_entropy(tp: int):
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    g, r = state.tp, state.tp.rank
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, V, (S, B), generator=gen)
    grad = torch.rand(S, B, generator=gen)
    base = torch.randn(S, B, V, generator=gen)
    # 1e4: exp would overflow fp32 without the max subtraction.
    for scale, smoothing in [(1.0, 0.0), (1.0, 0.1), (1e4, 0.0), (1e4, 0.1)]:
        case = f"tp={tp} scale={scale} label_smoothing={smoothing}"
        full = (base * scale).requires_grad_()
        # Megatron's smoothing spreads its mass over the v - 1 other tokens,
        # torch's over all v: the same loss with torch's e = a * v / (v - 1).
        torch_smoothing = smoothing * V / (V - 1)
        loss_ref = F.cross_entropy(
            full.reshape(-1, V),
            target.reshape(-1),
            reduction="none",
            label_smoothing=torch_smoothing,
        ).view(S, B)
        loss_ref.backward(grad)

        local = full.detach().chunk(tp, dim=-1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, g, label_smoothing=smoothing)
        assert loss.dtype == torch.float32 and loss.shape == (S, B), case
        # Large logits give large losses: the tolerance is relative to them.
        close(loss, loss_ref.detach(), f"{case}: loss", rtol=1e-5, atol=1e-5 * scale)
        loss.backward(grad)
        close(local.grad, full.grad.chunk(tp, dim=-1)[r], f"{case}: logits grad")
        assert torch.isfinite(loss).all() and torch.isfinite(local.grad).all(), case
    # Low-precision logits: the loss is fp32, the gradient in the logits' dtype.
    local = base.chunk(tp, dim=-1)[r].to(torch.bfloat16).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, g)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    loss_ref = F.cross_entropy(base.to(torch.bfloat16).float().reshape(-1, V), target.reshape(-1))
    close(loss.mean(), loss_ref, f"tp={tp} bf16 logits: loss")
    mp_state.destroy()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(tp):
    run_on_ranks(check_cross_entropy, tp, tp, timeout=60)


def test_cross_entropy_leaves_the_logits_untouched():
    def body():
        state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
        logits = torch.randn(S, B, V // 2)
        before = logits.clone()
        vocab_parallel_cross_entropy(logits, torch.zeros(S, B, dtype=torch.long), state.tp)
        torch.testing.assert_close(logits, before, rtol=0, atol=0)
        mp_state.destroy()

    run_on_ranks(body, 2, timeout=60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_over_several_chunks_of_rows(dtype):
    """150 tokens: two full chunks of 64 rows and a partial one, in both paths."""
    one_rank = mp_state.RankGroup("tp", (0,), 0, None)
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(75, 2, 40, generator=gen) * 4).to(dtype)
    target = torch.randint(0, 40, (75, 2), generator=gen)
    grad = torch.rand(75, 2, generator=gen)
    for smoothing in (0.0, 0.1):
        ours = logits.detach().clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(ours, target, one_rank, label_smoothing=smoothing)
        loss.backward(grad)
        ref = logits.detach().float().clone().requires_grad_()
        ref_loss = F.cross_entropy(ref.reshape(-1, 40), target.reshape(-1), reduction="none",
                                   label_smoothing=smoothing * 40 / 39).view(75, 2)  # fmt: skip
        ref_loss.backward(grad)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
        torch.testing.assert_close(ours.grad, ref.grad.to(dtype), **tolerance)


def test_gradient_written_over_the_logits_equals_the_separate_one():
    one_rank = mp_state.RankGroup("tp", (0,), 0, None)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(75, 2, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    target = torch.randint(0, 40, (75, 2), generator=gen)
    grad = torch.rand(75, 2, generator=gen)
    grads, pointers = {}, {}
    for in_place in (False, True):
        w = weight.clone().requires_grad_()
        logits = hidden @ w.t()  # not a leaf: computed by autograd
        pointers[in_place] = logits.data_ptr()
        loss = vocab_parallel_cross_entropy(logits, target, one_rank, grad_in_logits=in_place)
        seen = {}

        def note(g, seen=seen):
            seen["ptr"] = g.data_ptr()

        logits.register_hook(note)
        loss.backward(grad)
        grads[in_place] = w.grad
        assert (seen["ptr"] == pointers[in_place]) == in_place
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_gradient_over_the_logits_fails_loudly_when_they_are_needed_again():
    one_rank = mp_state.RankGroup("tp", (0,), 0, None)
    w = torch.randn(40, 16, requires_grad=True)
    logits = torch.randn(5, 2, 16) @ w.t()
    penalty = logits.pow(2).sum()  # saves the logits; its backward runs after the loss's
    target = torch.zeros(5, 2, dtype=torch.long)
    loss = vocab_parallel_cross_entropy(logits, target, one_rank, grad_in_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.sum() + penalty).backward()
    with pytest.raises(ValueError, match="grad_in_logits=True needs logits computed by autograd"):
        vocab_parallel_cross_entropy(torch.randn(5, 2, 40, requires_grad=True), target,
                                     one_rank, grad_in_logits=True)  # fmt: skip
