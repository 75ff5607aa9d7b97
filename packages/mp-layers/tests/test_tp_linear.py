"""Column- and row-parallel linear layers against torch.nn.Linear at TP 1, 2, 4.

Shapes: [s, b, h]. Every rank builds the same full input, weight and upstream
gradient, runs its parallel layer on its piece, and checks its output and
gradients against its piece of the single-process result (fp32, tolerances
RTOL / ATOL below: only the summation order differs).
"""

import functools
import itertools

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_ckpt import ShardedTensor, check_tiling
from mp_layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_sequence_parallel_grads,
)
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

# assert_close imports sympy on first use (about 2 s): once here, in the
# parent, rather than in every forked rank.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

RTOL, ATOL = 1e-5, 1e-5
S, B, IN, OUT = 8, 2, 16, 12
SEED = 1234
init_normal = functools.partial(torch.nn.init.normal_, std=0.5)


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def gather(piece: torch.Tensor, dim: int, group: mp_state.RankGroup) -> torch.Tensor:
    pieces = [torch.empty_like(piece) for _ in range(group.size)]
    dist.all_gather(pieces, piece.detach().contiguous(), group=group.group)
    return torch.cat(pieces, dim=dim)


def full_tensors(in_features: int, out_features: int):
    """Input, bias and upstream gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(S, B, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    grad = torch.randn(S, B, out_features, generator=gen)
    return x, bias, grad


def reference(weight, bias, x, grad):
    """torch.nn.Linear with the given full weight: output and gradients."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    x = x.clone().requires_grad_()
    y = linear(x)
    y.backward(grad)
    return y.detach(), x.grad, linear.weight.grad, linear.bias.grad


def check_column(tp: int):
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    g, r = state.tp, state.tp.rank
    x, bias, grad = full_tensors(IN, OUT)
    for sp, gather_output, skip in itertools.product([False, True], repeat=3):
        case = f"tp={tp} sequence_parallel={sp} gather_output={gather_output} skip_bias_add={skip}"
        mp_state.set_random_seeds(SEED, state)
        layer = ColumnParallelLinear(
            IN, OUT, tp_group=g, gather_output=gather_output, skip_bias_add=skip,
            sequence_parallel=sp, init_method=init_normal,
        )  # fmt: skip
        with torch.no_grad():
            layer.bias.copy_(bias.chunk(tp)[r])
        weight = gather(layer.weight, 0, g)
        y_ref, dx_ref, dw_ref, db_ref = reference(weight, bias, x, grad)

        x_local = (x.chunk(tp, dim=0)[r] if sp else x).clone().requires_grad_()
        y, returned_bias = layer(x_local)
        if skip:
            # Unadded: the output lacks the bias, which comes back as this rank's piece.
            close(returned_bias, bias.chunk(tp)[r], f"{case}: returned bias")
            y_ref = y_ref - bias
        else:
            assert returned_bias is None, case
        if gather_output:
            close(y, y_ref, f"{case}: output")
            y.backward(grad)
        else:
            close(y, y_ref.chunk(tp, dim=-1)[r], f"{case}: output")
            y.backward(grad.chunk(tp, dim=-1)[r])
        close(x_local.grad, dx_ref.chunk(tp, dim=0)[r] if sp else dx_ref, f"{case}: input grad")
        close(gather(layer.weight.grad, 0, g), dw_ref, f"{case}: weight grad")
        if not skip:
            close(gather(layer.bias.grad, 0, g), db_ref, f"{case}: bias grad")
    mp_state.destroy()


def check_row(tp: int):
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    g, r = state.tp, state.tp.rank
    x, bias, grad = full_tensors(IN, OUT)
    for sp, input_is_parallel, skip in itertools.product([False, True], repeat=3):
        if sp and not input_is_parallel:
            continue  # refused: see test_tp_arguments
        case = f"tp={tp} sequence_parallel={sp} input_is_parallel={input_is_parallel} skip={skip}"
        mp_state.set_random_seeds(SEED, state)
        layer = RowParallelLinear(
            IN, OUT, tp_group=g, input_is_parallel=input_is_parallel, skip_bias_add=skip,
            sequence_parallel=sp, init_method=init_normal,
        )  # fmt: skip
        with torch.no_grad():
            layer.bias.copy_(bias)
        weight = gather(layer.weight, 1, g)
        y_ref, dx_ref, dw_ref, db_ref = reference(weight, bias, x, grad)

        x_local = (x.chunk(tp, dim=-1)[r] if input_is_parallel else x).clone().requires_grad_()
        y, returned_bias = layer(x_local)
        if skip:
            close(returned_bias, bias, f"{case}: returned bias")
            y = y + returned_bias
        else:
            assert returned_bias is None, case
        y_expected, grad_local = (y_ref, grad)
        if sp:
            y_expected, grad_local = y_ref.chunk(tp, dim=0)[r], grad.chunk(tp, dim=0)[r]
        close(y, y_expected, f"{case}: output")
        y.backward(grad_local)
        close(
            x_local.grad,
            dx_ref.chunk(tp, dim=-1)[r] if input_is_parallel else dx_ref,
            f"{case}: input grad",
        )
        close(gather(layer.weight.grad, 1, g), dw_ref, f"{case}: weight grad")
        # Under sequence parallelism each rank's bias gradient covers its piece of s.
        assert layer.bias.sequence_parallel is sp, case
        all_reduce_sequence_parallel_grads(layer, g)
        close(layer.bias.grad, db_ref, f"{case}: bias grad")
    mp_state.destroy()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_linear_equals_nn_linear(tp):
    run_on_ranks(check_column, tp, tp, timeout=60)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_linear_equals_nn_linear(tp):
    run_on_ranks(check_row, tp, tp, timeout=60)


def global_weights_and_pieces(tp: int):
    """The gathered weights of freshly built layers, and every sharding description."""
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    g = state.tp
    mp_state.set_random_seeds(SEED, state)
    column = ColumnParallelLinear(IN, OUT, tp_group=g, init_method=init_normal)
    row = RowParallelLinear(OUT, IN, tp_group=g, init_method=init_normal)
    weights = {"column": gather(column.weight, 0, g), "row": gather(row.weight, 1, g)}
    pieces = {**column.sharded_state_dict("column."), **row.sharded_state_dict("row.")}
    described = [
        (p.key, p.data.detach().clone(), p.global_shape, p.global_offset, p.replica_id)
        for p in pieces.values()
    ]
    mp_state.destroy()
    return weights, described


def test_same_seed_gives_the_same_global_weights_and_pieces_tile_them():
    by_tp = {tp: run_on_ranks(global_weights_and_pieces, tp, tp, timeout=60) for tp in (1, 2, 4)}
    # The master weight, drawn as every rank draws it: seed, then the layers in order.
    torch.manual_seed(SEED)
    expected = {"column": torch.empty(OUT, IN), "row": torch.empty(IN, OUT)}
    for w in expected.values():
        init_normal(w)
    for tp, results in by_tp.items():
        for rank, (weights, _) in enumerate(results):
            for name, w in weights.items():
                torch.testing.assert_close(
                    w, expected[name], rtol=0, atol=0, msg=f"tp={tp} rank {rank} {name}"
                )
        pieces = [ShardedTensor(*d) for _, described in results for d in described]
        shapes = check_tiling(pieces)
        assert shapes == {
            "column.weight": (OUT, IN),
            "column.bias": (OUT,),
            "row.weight": (IN, OUT),
            "row.bias": (IN,),
        }
        # The saved pieces put together are the global weights.
        for name in ("column", "row"):
            whole = torch.full_like(expected[name], float("nan"))
            for p in pieces:
                if p.key == f"{name}.weight" and p.replica_id == 0:
                    whole[p.global_slices] = p.data
            torch.testing.assert_close(whole, expected[name], rtol=0, atol=0)
        replicas = sorted(p.replica_id for p in pieces if p.key == "row.bias")
        assert replicas == list(range(tp))
