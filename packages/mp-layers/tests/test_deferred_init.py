"""tensor_parallel.deferred_init: a weight recorded on the meta device and filled later,
in pieces of rows, equals the whole draw's piece bitwise, and recording it leaves the
default generator where the whole draw leaves it: for every partition (none, rows,
columns), tensor-parallel sizes 1 and 2, shapes whose sizes are and are not multiples of
16 (fewer than 16 elements too), a 3-d weight, and the gated MLP's fused fc1 layout; the
MoE experts (drawn expert by expert) and the router, at several expert layouts."""

import functools

import pytest
import torch

from mp_layers import TransformerConfig
from mp_layers.moe import GroupedExperts, TopKRouter
from mp_layers.tensor_parallel.deferred_init import (
    GatedRows,
    RowOrder,
    deferred_weights,
    fill_rows,
    record,
)
from mp_layers.transformer.shared_query_groups import SharedGroup
from mp_state import RankGroup

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


@pytest.mark.parametrize(("groups", "gated", "tp"), [(1, False, 2), (2, True, 4), (1, False, 4)])
def test_a_shared_query_groups_layout_is_filled_as_drawn(groups, gated, tp):
    """The QKV weight of query groups shared by TP ranks (8 heads of 8 channels, hidden 16):
    each rank's rows of the master drawn in the TP = 1 order, block by block."""
    for rank in range(tp):
        shared = SharedGroup(groups, 8 // groups, gated, 8, tp, rank)
        rows = groups * (8 // groups * (2 if gated else 1) + 2) * 8
        order = shared.init_method(NORMAL)
        assert isinstance(order, RowOrder)
        piece, out, same_state = whole_then_deferred((rows, 16), 0, tp, rank, order, pieces=5)
        assert same_state and torch.equal(out, piece), (groups, gated, tp, rank)
        torch.manual_seed(3)
        canonical = torch.empty(rows, 16)
        NORMAL(canonical)
        assert torch.equal(
            piece, canonical[shared.in_rank_order()].narrow(0, rank * len(out), len(out))
        )


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


def moe_config(gated: bool, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    return TransformerConfig(
        num_layers=3, hidden_size=24, num_attention_heads=4, ffn_hidden_size=48,
        activation="swiglu" if gated else "gelu", add_bias_linear=not gated,
        num_moe_experts=4, moe_ffn_hidden_size=20, moe_router_topk=2,
        params_dtype=dtype,
    )  # fmt: skip


def group(size: int, rank: int) -> RankGroup:
    return RankGroup("stub", tuple(range(size)), rank, None)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize(("ep", "etp"), [(1, 1), (2, 1), (2, 2), (1, 2), (4, 1)])
def test_experts_filled_later_are_the_whole_draws(gated, ep, etp):
    """Each expert-parallel and expert-TP rank's experts, filled an expert or two at a
    time from the recipe, equal the whole build's (both weights, bf16 rounding included);
    the generator ends where the whole build leaves it; the biases are zeros as built."""
    config = moe_config(gated, torch.bfloat16)
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            torch.manual_seed(5)
            whole = GroupedExperts(config, group(ep, ep_rank), group(etp, etp_rank))
            after = torch.get_rng_state()
            torch.manual_seed(5)
            with deferred_weights():
                later = GroupedExperts(config, group(ep, ep_rank), group(etp, etp_rank))
            assert torch.equal(torch.get_rng_state(), after), (ep_rank, etp_rank)
            for name in ("linear_fc1", "linear_fc2"):
                built, meta = getattr(whole, name), getattr(later, name)
                assert meta.weight.is_meta and meta.weight.dtype == torch.bfloat16
                assert getattr(meta.weight, "expert_parallel", False)
                recipe = meta.weight._mp_deferred_init
                out = torch.full(meta.weight.shape, float("nan"))
                for start in range(0, out.shape[0], 2):  # FSDP's shards of experts
                    stop = min(start + 2, out.shape[0])
                    recipe.fill_rows(start, stop, out[start:stop], torch.bfloat16)
                recipe.fill_rows(1, 1, out[1:1])  # an empty shard writes nothing
                assert torch.equal(out, built.weight.float()), (name, ep_rank, etp_rank)
                if built.bias is not None:
                    assert not meta.bias.is_meta and torch.equal(meta.bias, built.bias)


def test_the_router_is_filled_later_as_drawn():
    config = moe_config(True)
    torch.manual_seed(9)
    whole = TopKRouter(config, group(2, 1))
    after = torch.get_rng_state()
    torch.manual_seed(9)
    with deferred_weights():
        later = TopKRouter(config, group(2, 1))
    assert later.weight.is_meta and torch.equal(torch.get_rng_state(), after)
    out = torch.full(later.weight.shape, float("nan"))
    later.weight._mp_deferred_init.fill_rows(0, 3, out[:3])
    later.weight._mp_deferred_init.fill_rows(3, 4, out[3:])
    assert torch.equal(out, whole.weight)
