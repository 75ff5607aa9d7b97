"""tensor_parallel.deferred_init: a weight recorded on the meta device and filled later,
in pieces of rows, equals the whole draw's piece bitwise, and recording it leaves the
default generator where the whole draw leaves it: for every partition (none, rows,
columns), tensor-parallel sizes 1 and 2, shapes whose sizes are and are not multiples of
16 (fewer than 16 elements too), a 3-d weight, and the gated MLP's fused fc1 layout."""

import functools

import pytest
import torch

from mp_layers.tensor_parallel.deferred_init import GatedRows, fill_rows, record

NORMAL = functools.partial(torch.nn.init.normal_, std=0.02)
SHAPES = [(64, 64), (192, 64), (7, 3), (100, 13), (5, 4), (2, 3), (1000, 17), (33, 4096),
          (3, 5, 7)]  # fmt: skip


def whole_then_deferred(shape, dim, tp, rank, init, pieces=3):
    torch.manual_seed(3)
    master = torch.empty(shape)
    init(master)
    after = torch.get_rng_state()
    size = shape[dim] // tp if dim is not None else None
    piece = master if dim is None else master.narrow(dim, rank * size, size)
    torch.manual_seed(3)
    weight = torch.empty(piece.shape, device="meta")
    record(weight, shape, dim, rank, init)
    same_state = torch.equal(torch.get_rng_state(), after)
    out = torch.full(piece.shape, float("nan"))
    rows = piece.shape[0]
    step = -(-rows // pieces)
    for start in range(0, rows, step):  # uneven pieces, as FSDP's last shard
        stop = min(start + step, rows)
        fill_rows(weight._mp_deferred_init, start, stop, out[start:stop])
    return piece, out, same_state


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_filled_later_are_the_whole_draws(shape):
    for dim in (None, 0, 1) if len(shape) == 2 else (None, 0):
        for tp in (1, 2):
            if dim is not None and shape[dim] % tp:
                continue
            for rank in range(tp):
                piece, out, same_state = whole_then_deferred(shape, dim, tp, rank, NORMAL)
                assert same_state, (shape, dim, tp, rank)
                assert torch.equal(out, piece), (shape, dim, tp, rank)


@pytest.mark.parametrize(("f", "h", "tp"), [(8, 4, 2), (6, 5, 3), (352, 128, 1), (352, 128, 4)])
def test_the_gated_layout_is_filled_as_drawn(f, h, tp):
    for rank in range(tp):
        gated = GatedRows(NORMAL, tp)
        piece, out, same_state = whole_then_deferred((2 * f, h), 0, tp, rank, gated)
        assert same_state and torch.equal(out, piece), (f, h, tp, rank)


def test_other_init_methods_are_drawn_whole_with_the_same_values():
    uniform = functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)
    piece, out, same_state = whole_then_deferred((40, 24), 1, 2, 1, uniform)
    assert same_state and torch.equal(out, piece)


def test_rounding_through_the_model_dtype():
    piece, _, _ = whole_then_deferred((32, 16), 0, 1, 0, NORMAL)
    torch.manual_seed(3)
    weight = torch.empty(32, 16, device="meta")
    record(weight, (32, 16), 0, 0, NORMAL)
    out = torch.empty(32, 16)
    fill_rows(weight._mp_deferred_init, 0, 32, out, torch.bfloat16)
    assert torch.equal(out, piece.bfloat16().float())
