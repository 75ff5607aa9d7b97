"""Muon (mp_optim.muon): the Newton-Schulz iteration orthogonalizes, the coefficient sets
cycle or repeat their last as published, the update follows Megatron's rule step by step,
fused query/key/value weights are orthogonalized part by part, and a matrix split over
tensor-parallel ranks gets the whole matrix's update (duplicated, distributed) or each
block's own (blockwise)."""

import pytest
import torch
import torch.distributed as dist

from mp_optim.muon import (
    COEFFICIENT_TYPES,
    MatrixLayout,
    Muon,
    _coefficients,
    _matmul_precision,
    newton_schulz,
    scale_factor,
)
from mp_state import RankGroup
from mp_state.testing import run_on_ranks


def spread(rows: int, cols: int, seed: int = 0, batch: tuple = ()) -> torch.Tensor:
    """A matrix (or batch) with singular values spread over two decades (what five quintic
    iterations lift to about 1)."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(*batch, rows, k, generator=g))[0]
    v = torch.linalg.qr(torch.randn(*batch, cols, k, generator=g))[0]
    return 1e-2 * u @ torch.diag(torch.logspace(0, -2, k)) @ v.mT


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 24)])
def test_the_iteration_drives_singular_values_towards_one(shape):
    x = spread(*shape[-2:], batch=shape[:-2])
    out = newton_schulz(x, 5, "quintic")
    assert out.shape == x.shape and out.dtype == torch.float32
    sv = torch.linalg.svdvals(out)
    # Muon's quintic coefficients trade exactness for speed: about (0.7, 1.2), not 1
    assert sv.min() > 0.5 and sv.max() < 1.3, sv
    assert torch.linalg.svdvals(x).max() < 0.02  # the input was far from orthogonal
    # the same left and right singular vectors: U V^T of the input, up to that band
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    assert torch.allclose(out, u @ vh, atol=0.35)


def test_medium_precision_runs_the_iteration_in_bf16():
    x = spread(24, 40)
    with _matmul_precision("high"):
        fp32 = newton_schulz(x, 5, "quintic")
    with _matmul_precision("medium"):
        bf16 = newton_schulz(x, 5, "quintic")
    assert not torch.equal(fp32, bf16)
    assert (fp32 - bf16).abs().max() < 0.05


def test_coefficient_sets_cycle_or_repeat_the_last():
    quintic = _coefficients("quintic", 7)
    assert quintic[5] == quintic[0] and quintic[6] == quintic[1]  # cycled
    polar = _coefficients("polar_express", 10)
    assert polar[8] == polar[9] == polar[7]  # the last repeated
    assert len(_coefficients("deepseekv4", 10)) == 10
    assert _coefficients("deepseekv4", 10)[8] == (2.0, -1.5, 0.5)
    assert set(COEFFICIENT_TYPES) == {"simple", "quintic", "polar_express", "cans", "aol",
                                      "deepseekv4"}  # fmt: skip
    with pytest.raises(ValueError, match="coefficient type 'custom'"):
        _coefficients("custom", 5)


def test_scale_factors():
    assert scale_factor(16, 64, "spectral") == 8.0
    assert scale_factor(64, 16, "unit_rms_norm") == 2.0
    assert scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0
    with pytest.raises(ValueError, match="scale mode 'rms'"):
        scale_factor(1, 1, "rms")


def reference_step(w, buf, grad, *, lr, momentum, wd, nesterov, decoupled, extra, mode):
    """Megatron's rule written out (module docstring of mp_optim.muon)."""
    if decoupled:
        w = w * (1 - lr * wd)
    else:
        grad = grad + wd * w
    buf = momentum * buf + (1 - momentum) * grad
    update = grad + momentum * (buf - grad) if nesterov else buf
    with _matmul_precision("high"):
        orth = newton_schulz(update, 5, "quintic")
    return w - lr * orth * scale_factor(*w.shape, mode) * extra, buf


@pytest.mark.parametrize("nesterov,decoupled,mode", [(False, True, "spectral"),
                                                     (True, True, "unit_rms_norm"),
                                                     (False, False, "shape_scaling")])  # fmt: skip
def test_the_update_is_megatrons_rule(nesterov, decoupled, mode):
    hyper = dict(lr=0.02, momentum=0.9, wd=0.1, nesterov=nesterov, decoupled=decoupled,
                 extra=0.2, mode=mode)  # fmt: skip
    w0 = spread(24, 40, seed=1) * 100
    param = w0.clone().requires_grad_()
    optimizer = Muon([param], lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov,
                     decoupled_weight_decay=decoupled, scale_mode=mode,
                     extra_scale_factor=0.2, matmul_precision="high")  # fmt: skip
    w, buf = w0.clone(), torch.zeros_like(w0)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        grad = torch.randn(w0.shape, generator=g) * 1e-2
        param.grad = grad.clone()
        optimizer.step()
        w, buf = reference_step(w, buf, grad, **hyper)
        assert torch.allclose(param.detach(), w, atol=1e-6, rtol=0)
    assert torch.allclose(optimizer.state[param]["momentum_buffer"], buf, atol=1e-7)


def test_a_group_sets_its_own_lr_and_weight_decay():
    a, b = (torch.ones(8, 8, requires_grad=True) for _ in range(2))
    optimizer = Muon([{"params": [a], "weight_decay": 0.5}, {"params": [b], "lr": 0.0}],
                     lr=0.1, weight_decay=0.0)  # fmt: skip
    a.grad, b.grad = torch.zeros(8, 8), torch.ones(8, 8)
    optimizer.step()
    assert torch.allclose(a.detach(), torch.full((8, 8), 0.95))  # decayed, no update
    assert torch.equal(b.detach(), torch.ones(8, 8))  # lr 0


def test_split_qkv_orthogonalizes_each_part_of_every_query_group():
    # 2 query groups of [q 8 rows, k 4, v 4], hidden 16
    update = spread(32, 16, seed=3)
    layout = MatrixLayout(qkv_rows=(8, 4, 4))
    optimizer = Muon([torch.zeros(32, 16)], lr=1.0, matmul_precision="high",
                     layouts={})  # fmt: skip
    p = optimizer.param_groups[0]["params"][0]
    optimizer.layouts[id(p)] = layout
    got = optimizer.orthogonalize(p, update)
    grouped = update.view(2, 16, 16)
    want = torch.empty_like(grouped)
    start = 0
    for rows in (8, 4, 4):
        part = grouped[:, start : start + rows].reshape(-1, 16)
        with _matmul_precision("high"):
            orth = newton_schulz(part, 5, "quintic") * scale_factor(*part.shape, "spectral")
        want[:, start : start + rows] = orth.view(2, rows, 16)
        start += rows
    assert torch.allclose(got, want.view(32, 16), atol=1e-6)
    optimizer.split_qkv = False
    with _matmul_precision("high"):
        whole = newton_schulz(update, 5, "quintic") * scale_factor(32, 16, "spectral")
    assert torch.allclose(optimizer.orthogonalize(p, update), whole, atol=1e-6)


def test_experts_are_orthogonalized_one_by_one():
    update = spread(16, 24, seed=4, batch=(3,))
    optimizer = Muon([torch.zeros(3, 16, 24)], lr=1.0, matmul_precision="high")
    p = optimizer.param_groups[0]["params"][0]
    got = optimizer.orthogonalize(p, update)
    for e in range(3):
        with _matmul_precision("high"):
            want = newton_schulz(update[e], 5, "quintic") * scale_factor(16, 24, "spectral")
        assert torch.allclose(got[e], want, atol=1e-6)


CASES = [
    (mode, shape, dim)
    for mode in ("duplicated", "distributed", "blockwise")
    for shape, dim in (((24, 40), 0), ((24, 40), 1), ((2, 16, 24), 1), ((2, 16, 24), 2))
]


def tp_updates() -> list[torch.Tensor]:
    """On a rank of 2, each case's: this rank's block of the orthogonalized matrix (or
    batch), split along dim."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group = RankGroup("tp", (0, 1), rank, dist.group.WORLD)
    out = []
    for mode, shape, dim in CASES:
        block = spread(*shape[-2:], seed=5, batch=shape[:-2]).chunk(2, dim=dim)[rank]
        optimizer = Muon([torch.zeros_like(block)], lr=1.0, tp_mode=mode,
                         matmul_precision="high")  # fmt: skip
        p = optimizer.param_groups[0]["params"][0]
        optimizer.layouts[id(p)] = MatrixLayout(partition_dim=dim, group=group)
        out.append(optimizer.orthogonalize(p, block.contiguous()))
    return out


@pytest.mark.multirank
def test_tensor_parallel_blocks_get_their_part_of_the_whole():
    ranks = run_on_ranks(tp_updates, 2)
    for i, (mode, shape, dim) in enumerate(CASES):
        full = spread(*shape[-2:], seed=5, batch=shape[:-2])
        optimizer = Muon([torch.zeros(shape)], lr=1.0, matmul_precision="high")
        p = optimizer.param_groups[0]["params"][0]
        if mode == "blockwise":  # each block orthogonalized (and scaled) on its own
            want = [optimizer.orthogonalize(p, b.contiguous()) for b in full.chunk(2, dim=dim)]
        else:
            want = list(optimizer.orthogonalize(p, full).chunk(2, dim=dim))
        for rank, expected in enumerate(want):
            got = ranks[rank][i]
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (mode, shape, dim, rank)
        if mode != "blockwise":  # the blocks differ from orthogonalizing each alone
            alone = optimizer.orthogonalize(p, full.chunk(2, dim=dim)[0].contiguous())
            assert not torch.allclose(ranks[0][i], alone, atol=1e-3)
