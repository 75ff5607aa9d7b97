"""Each autograd mapping, forward and backward, at world size 4 against manual results.

Shapes: [s, b, h]; every rank r holds its own x_r and upstream gradient g_r,
which all ranks can recompute, so each rank checks its result on its own.
"""

import pytest
import torch

import mp_state
from mp_layers.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

# assert_close imports sympy on first use (about 2 s): once here, in the
# parent, rather than in every forked rank.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

TP = 4
S, B, H = 8, 2, 12


def per_rank(seed: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """One distinct tensor per rank, the same list on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(TP)]


def run_mapping(fn, x: torch.Tensor, grad: torch.Tensor, *args):
    x = x.clone().requires_grad_()
    y = fn(x, *args)
    y.backward(grad)
    return y.detach(), x.grad


def check_mappings():
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=TP))
    g, r = state.tp, state.tp.rank
    full, split_h, split_s = (S, B, H), (S, B, H // TP), (S // TP, B, H)

    def piece(t, dim):
        return t.chunk(TP, dim=dim)[r]

    # copy: identity forward, gradients summed.
    xs, gs = per_rank(1, full), per_rank(2, full)
    y, dx = run_mapping(copy_to_tensor_model_parallel_region, xs[r], gs[r], g)
    torch.testing.assert_close(y, xs[r])
    torch.testing.assert_close(dx, sum(gs))

    # reduce: sum forward, gradient passed through.
    y, dx = run_mapping(reduce_from_tensor_model_parallel_region, xs[r], gs[r], g)
    torch.testing.assert_close(y, sum(xs))
    torch.testing.assert_close(dx, gs[r])

    # scatter along h: the same x on every rank; the backward gathers the pieces.
    x = per_rank(3, full)[0]
    gs_h = per_rank(4, split_h)
    y, dx = run_mapping(scatter_to_tensor_model_parallel_region, x, gs_h[r], g)
    torch.testing.assert_close(y, piece(x, -1))
    torch.testing.assert_close(dx, torch.cat(gs_h, dim=-1))

    # gather along h; the backward keeps this rank's piece of its own gradient.
    xs_h = per_rank(5, split_h)
    y, dx = run_mapping(gather_from_tensor_model_parallel_region, xs_h[r], gs[r], g)
    torch.testing.assert_close(y, torch.cat(xs_h, dim=-1))
    torch.testing.assert_close(dx, piece(gs[r], -1))

    # scatter along s.
    gs_s = per_rank(6, split_s)
    y, dx = run_mapping(scatter_to_sequence_parallel_region, x, gs_s[r], g)
    torch.testing.assert_close(y, piece(x, 0))
    torch.testing.assert_close(dx, torch.cat(gs_s, dim=0))

    # gather along s: reduce-scatter backward by default, split when told the
    # output is replicated.
    xs_s = per_rank(7, split_s)
    y, dx = run_mapping(gather_from_sequence_parallel_region, xs_s[r], gs[r], g)
    torch.testing.assert_close(y, torch.cat(xs_s, dim=0))
    torch.testing.assert_close(dx, piece(sum(gs), 0))
    y, dx = run_mapping(gather_from_sequence_parallel_region, xs_s[r], gs[r], g, False)
    torch.testing.assert_close(y, torch.cat(xs_s, dim=0))
    torch.testing.assert_close(dx, piece(gs[r], 0))

    # reduce-scatter along s; the backward gathers.
    y, dx = run_mapping(reduce_scatter_to_sequence_parallel_region, xs[r], gs_s[r], g)
    torch.testing.assert_close(y, piece(sum(xs), 0))
    torch.testing.assert_close(dx, torch.cat(gs_s, dim=0))

    # A split dimension that tp does not divide is refused, before any collective.
    with pytest.raises(ValueError, match=r"input.shape\[-1\]=6"):
        scatter_to_tensor_model_parallel_region(torch.zeros(2, 6), g)
    with pytest.raises(ValueError, match=r"input.shape\[0\]=6"):
        reduce_scatter_to_sequence_parallel_region(torch.zeros(6, 2), g)
    mp_state.destroy()


def test_mappings_forward_and_backward_at_world_size_4():
    run_on_ranks(check_mappings, TP, timeout=60)


def identity_at_size_1():
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=1))
    x = torch.randn(4, 2, 6)
    for fn in (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        scatter_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    ):
        y, dx = run_mapping(fn, x, 2 * x, state.tp)
        torch.testing.assert_close(y, x, rtol=0, atol=0)
        torch.testing.assert_close(dx, 2 * x, rtol=0, atol=0)
    mp_state.destroy()


def test_mappings_are_identities_in_a_group_of_one():
    run_on_ranks(identity_at_size_1, 1, timeout=60)
