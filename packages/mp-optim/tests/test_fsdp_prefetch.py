"""The order FullyShardedDataParallel (ZeRO-3, 2 ranks) issues its all-gathers in, read
from torch.profiler's ranges on the main thread, not from timing: with
overlap_param_gather each unit's forward issues the next unit's all-gather before the
unit's own compute ends (FSDP2's explicit forward prefetch); without it, each unit
gathers at its own forward, after the previous unit's compute. In backward FSDP2 gathers
the previous unit before this unit's backward is done either way.

A unit's forward compute is marked by a record_function range around it; the end of its
backward by a range its input's gradient opens (an identity autograd function on the
input, whose backward runs when the unit's backward has produced that gradient). An
all-gather is FSDP2's own range `FSDP::all_gather (units.i)`, which issues it."""

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import mp_state
from mp_ckpt import ShardedTensor
from mp_optim import FullyShardedDataParallel, OptimizerConfig
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

UNITS = 3


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward opens an empty profiler range named `name`."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with record_function(ctx.name):
            pass
        return grad, None


class Unit(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = _BackwardMark.apply(x, f"unit {self.index} backward done")
        with record_function(f"unit {self.index} compute"):
            return torch.tanh(self.linear(x))


class Chunk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.units = torch.nn.ModuleList(Unit(i) for i in range(UNITS))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return self.head(x)

    def sharded_state_dict(self, prefix=""):
        return {
            f"{prefix}{name}": ShardedTensor(
                f"{prefix}{name}", p.data, tuple(p.shape), (0,) * p.dim()
            )
            for name, p in self.named_parameters()
        }


def ranges_body(overlap: bool) -> tuple[list[tuple[str, float, float]], set[bool]]:
    """The main thread's profiler ranges (name, start, end) of the second step, and
    whether FSDP2 issues each unit's all-gathers asynchronously."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    config = OptimizerConfig(
        lr=0.1, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=overlap, overlap_param_gather=overlap,
    )  # fmt: skip
    model = FullyShardedDataParallel(config, Chunk(), dp_group=state.dp, units=(Unit,))
    # An input that needs a gradient, so that unit 0's backward mark runs too.
    x = torch.full((2, 8), dist.get_rank() + 1.0, requires_grad=True)
    model(x).sum().backward()  # the first step also initializes FSDP2's state lazily
    model.finish_grad_sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
        model.finish_grad_sync()
    main = next(e.thread for e in prof.events() if e.name == "FSDP::root_pre_forward")
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.thread == main]  # fmt: skip
    asynchronous = {
        group.unshard_async_op
        for unit in model.unit_modules
        for group in unit._get_fsdp_state()._fsdp_param_groups
    }
    mp_state.destroy()
    dist.barrier()
    return sorted(ranges, key=lambda r: r[1]), asynchronous


def order_of(ranges) -> dict[str, list[float]]:
    """Per unit: where its forward compute ends, where its forward and backward
    all-gathers start, where its backward is done."""

    def starts(name):
        return [start for n, start, _ in ranges if n == name]

    found = {"compute_end": [], "forward_gather": [], "backward_gather": [], "backward_done": []}
    for i in range(UNITS):
        (compute_end,) = [end for n, _, end in ranges if n == f"unit {i} compute"]
        (backward_done,) = starts(f"unit {i} backward done")
        gathers = starts(f"FSDP::all_gather (units.{i})")
        assert len(gathers) == 2, f"units.{i}: expected a forward and a backward all-gather"
        found["compute_end"].append(compute_end)
        found["forward_gather"].append(gathers[0])
        found["backward_gather"].append(gathers[1])
        found["backward_done"].append(backward_done)
    return found


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_param_gather", "plain"])
def test_forward_prefetch_issues_the_next_all_gather_before_the_compute_ends(overlap):
    for rank, (ranges, asynchronous) in enumerate(
        run_on_ranks(ranges_body, 2, overlap, timeout=60)
    ):
        # On the CPU the flag also makes the all-gathers asynchronous, so that a prefetched
        # one runs on gloo's thread while the unit before computes.
        assert asynchronous == {overlap}, (rank, asynchronous)
        order = order_of(ranges)
        for i in range(UNITS - 1):
            following = order["forward_gather"][i + 1]
            # With the prefetch, before unit i's compute ends; without, after it.
            assert (following < order["compute_end"][i]) == overlap, (rank, i, order)
            # Backward runs units in reverse: unit i + 1's backward, then unit i's; FSDP2
            # gathers unit i before unit i + 1's backward is done, with or without the flag.
            assert order["backward_gather"][i] < order["backward_done"][i + 1], (rank, i, order)


def test_a_torch_without_asynchronous_all_gathers_is_logged(caplog):
    from mp_optim.fsdp import _gather_asynchronously

    with caplog.at_level("WARNING", logger="mp_optim.fsdp"):
        _gather_asynchronously(torch.nn.Linear(2, 2))  # no FSDP2 switch on it
    assert "has no _set_unshard_async_op" in caplog.text
