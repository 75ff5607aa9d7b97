"""--cross-entropy-loss-fusion: the cross entropy's passes over the logits compiled
(fused_cross_entropy.py) against the unfused pieces, on the CPU through inductor.

Rows are cut into pieces of 1,024 per compiled call: 1,100 rows give a whole piece and a
short one. The loss and the logits' gradient must equal the unfused path's within fp32
rounding (the sums are reduced in another order), in fp32 with label smoothing and
with the gradient written over the logits, and in bf16 with the gradient in a tensor
of its own; and a GPT model's loss and every parameter's gradient, with the whole
output loss and with the chunked one.
"""

import pytest
import torch

import mp_state
from mp_layers import GPTModel, ModelGroups, TransformerConfig
from mp_layers.tensor_parallel import vocab_parallel_cross_entropy

ONE_RANK = mp_state.RankGroup("tp", (0,), 0, None)


@pytest.mark.parametrize(
    ("dtype", "smoothing", "grad_in_logits"),
    [(torch.float32, 0.1, True), (torch.bfloat16, 0.0, False)],
)
def test_fused_passes_equal_the_unfused_ones(dtype, smoothing, grad_in_logits):
    gen = torch.Generator().manual_seed(0)
    n, v = 1100, 320
    base = (torch.randn(n, 1, v, generator=gen) * 4).to(dtype)
    target = torch.randint(0, v, (n, 1), generator=gen)
    grad = torch.rand(n, 1, generator=gen)
    results = {}
    for fused in (False, True):
        x = base.clone().requires_grad_()
        logits = x * 1  # computed by autograd, so that its memory may take the gradient
        loss = vocab_parallel_cross_entropy(logits, target, ONE_RANK, smoothing,
                                            grad_in_logits=grad_in_logits, fused=fused)  # fmt: skip
        loss.backward(grad)
        results[fused] = (loss.detach(), x.grad)
    (loss, x_grad), (fused_loss, fused_grad) = results[False], results[True]
    assert fused_loss.dtype == torch.float32 and fused_grad.dtype == dtype
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(fused_grad, x_grad, rtol=1e-5, atol=1e-7)
    else:  # the same fp32 value up to the sum's order, rounded once to bf16
        torch.testing.assert_close(fused_grad, x_grad, rtol=2**-7, atol=1e-6)
        assert (fused_grad != x_grad).float().mean() < 0.01


@pytest.mark.parametrize("chunk", [0, 7])
def test_gpt_model_loss_and_gradients_with_fusion(chunk):
    s, b, v = 16, 2, 250
    ids = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(2))
    results = []
    for fusion in (False, True):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   output_loss_chunk_tokens=chunk,
                                   cross_entropy_loss_fusion=fusion)  # fmt: skip
        model = GPTModel(config, "local", v, s, groups=ModelGroups.single())
        loss = model(ids, labels=ids.roll(-1, dims=1))
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_transformer_engine_implementation_is_refused():
    with pytest.raises(ValueError, match="cross_entropy_fusion_impl='te' needs Transformer"):
        TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4,
            cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te",
        )  # fmt: skip
