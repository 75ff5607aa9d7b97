"""Gradient norm, clipping and the count of zeros on one rank.

Across ranks: test_dp_equivalence (dense), test_expert_params (dense and expert).
"""

import pytest
import torch

from mp_optim import clip_grads_by_total_norm, count_zeros, get_grad_norm


def test_norm_clip_and_zeros():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])]
    assert get_grad_norm(grads, []) == pytest.approx(5.0)
    assert count_zeros(grads, []) == 4
    clip_grads_by_total_norm(grads, max_norm=1.0, total_norm=5.0)
    assert get_grad_norm(grads, []) == pytest.approx(1.0, rel=1e-6)
    torch.testing.assert_close(grads[0], torch.tensor([0.6, 0.0]), rtol=1e-5, atol=0)


def test_no_clipping_below_the_limit_and_bf16_norm_in_fp32():
    grads = [torch.tensor([0.3, 0.4])]
    clip_grads_by_total_norm(grads, max_norm=1.0, total_norm=0.5)
    torch.testing.assert_close(grads[0], torch.tensor([0.3, 0.4]), rtol=0, atol=0)
    big = [torch.full((4,), 300.0, dtype=torch.bfloat16)]
    assert get_grad_norm(big, []) == pytest.approx(600.0)
    assert get_grad_norm([], []) == 0.0


def test_expert_gradients_add_to_the_dense_ones():
    dense, expert = [torch.tensor([3.0, 0.0])], [torch.tensor([0.0, 4.0, 0.0])]
    assert get_grad_norm(dense, [], expert_grads=expert, expert_groups=[]) == pytest.approx(5.0)
    assert count_zeros(dense, [], expert_grads=expert, expert_groups=[]) == 3
    with pytest.raises(ValueError, match="1 expert gradients given without expert_groups"):
        get_grad_norm(dense, [], expert_grads=expert)


def test_large_cpu_gradient_norm_is_accurate():
    """A 4M-element gradient: torch's fp32 norm on the CPU came out 8e-5 relative from the
    fp64 one; summed in pieces, 3e-9."""
    grad = torch.randn(2**22, generator=torch.Generator().manual_seed(0))
    exact = float(grad.double().norm())
    assert get_grad_norm([grad], []) == pytest.approx(exact, rel=1e-7)
