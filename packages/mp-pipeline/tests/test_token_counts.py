"""A micro-batch without loss tokens (an SFT sample whose answer was cut off) adds nothing
to the loss and its gradients, as in Megatron-LM, whose schedule divides a (loss,
num_tokens) pair by the count clamped to at least 1: not 0 / 0, which made the whole
step's gradients NaN. The same for a global batch without any, under per-token loss."""

import pytest
import torch

import mp_state
from mp_pipeline import PipelineConfig, finalize_model_grads, forward_backward_no_pipelining
from mp_pipeline.testing import TanhStack
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

S, B, H = 4, 2, 6


def micro_batches(masks: list[float]):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(S, B, H, generator=generator), torch.randn(S, B, H, generator=generator),
             torch.full((S, B, 1), mask)) for mask in masks]  # fmt: skip


def stack() -> TanhStack:
    torch.manual_seed(0)
    return TanhStack([torch.nn.Linear(H, H)], first=True)


def forward_step(data_iterator, model):
    x, y, mask = next(data_iterator)

    def loss_func(output):
        errors = ((output - y) ** 2 * mask).sum()
        return errors, mask.sum() * H, {"loss": errors.detach()}

    return model(x), loss_func


def gradients(masks: list[float], per_token: bool = False):
    model = stack()
    config = PipelineConfig(seq_length=S, micro_batch_size=B, hidden_size=H,
                            calculate_per_token_loss=per_token)  # fmt: skip
    if per_token:
        state = mp_state.current()
        config.finalize_model_grads_func = lambda chunks, tokens: finalize_model_grads(
            chunks, tokens, state=state
        )
    forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(masks)), model=model,
        num_microbatches=len(masks), config=config,
    )  # fmt: skip
    return [p.grad for p in model.parameters()]


def test_a_micro_batch_without_loss_tokens_adds_nothing():
    got = gradients([1.0, 0.0, 1.0])
    # The two counted micro-batches, each its mean, averaged over all three.
    model = stack()
    data = micro_batches([1.0, 0.0, 1.0])
    total = sum(((model(x) - y) ** 2).mean() for x, y, _ in (data[0], data[2])) / 3
    total.backward()
    torch.testing.assert_close(got, [p.grad for p in model.parameters()])


def per_token_without_tokens():
    torch.set_num_threads(1)
    mp_state.initialize(ParallelConfig())
    return gradients([0.0, 0.0], per_token=True)


@pytest.mark.multirank
def test_a_global_batch_without_loss_tokens_keeps_zero_gradients_under_per_token_loss():
    [grads] = run_on_ranks(per_token_without_tokens, 1, timeout=120)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), grads
