"""The distributed optimizer equals the plain one and holds 1/dp of its state per rank; cut
into two instances (Megatron's --num-distributed-optimizer-instances 2), 2/dp."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_optim import DistributedDataParallel, InstanceGroups, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def make_model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.GELU(),
        torch.nn.Linear(256, 64),
    )  # fmt: skip
    return model.to(dtype)


def state_bytes(optimizer) -> int:
    """Bytes of the Adam moments and of the fp32 main parameters that are copies."""
    moments = sum(
        t.numel() * t.element_size()
        for state in optimizer.optimizer.state.values()
        for name, t in state.items()
        if name != "step"
    )
    copies = sum(
        s.main_param.numel() * s.main_param.element_size()
        for s in optimizer._all_shards()
        if not s.aliased
    )
    return moments + copies


def run(distributed: bool, dtype, state, **options):
    config = OptimizerConfig(
        lr=1e-3, bf16=dtype == torch.bfloat16, use_distributed_optimizer=distributed,
        bucket_size=5000, clip_grad=1.0, **options,
    )  # fmt: skip
    instances = None
    if state.intra_dp_cp is not None and distributed:
        instances = InstanceGroups(state.intra_dp_cp, state.inter_dp_cp)
    model = DistributedDataParallel(config, make_model(dtype), dp_group=state.dp,
                                    instances=instances)  # fmt: skip
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    generator = torch.Generator().manual_seed(5 + state.dp.rank)
    for _ in range(3):
        optimizer.zero_grad()
        x = torch.randn(16, 64, generator=generator).to(dtype)
        model(x).float().square().mean().backward()
        model.finish_grad_sync()
        assert optimizer.step().update_successful
    model.finish_param_sync()  # (gathers still running with overlap_param_gather)
    params = [p.detach().float().clone() for p in model.module.parameters()]
    return params, state_bytes(optimizer)


def body(dtype):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    plain, plain_bytes = run(False, dtype, state)
    sharded, sharded_bytes = run(True, dtype, state)
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(sharded, plain, strict=True))
    mp_state.destroy()
    dist.barrier()
    return {"error": error, "plain": plain_bytes, "sharded": sharded_bytes}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_distributed_optimizer_equals_plain_with_a_quarter_of_the_state(dtype):
    results = run_on_ranks(body, 4, dtype, timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] < 1e-6, f"rank {rank}: parameters differ by {r['error']:.2e}"
        ratio = r["sharded"] / (r["plain"] / 4)
        assert 0.95 <= ratio <= 1.05, (
            f"rank {rank}: {r['sharded']} bytes of optimizer state against "
            f"{r['plain']} / 4 unsharded (ratio {ratio:.3f})"
        )
    # bf16 holds fp32 main parameters as well: 3 fp32 values per element, else 2.
    per_element = 12 if dtype == torch.bfloat16 else 8
    assert results[0]["plain"] == per_element * sum(
        p.numel() for p in make_model(dtype).parameters()
    )


def instances_body(options: dict):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(num_distributed_optimizer_instances=2))
    gathers = {k: v for k, v in options.items() if k != "overlap_param_gather"}
    plain, plain_bytes = run(False, torch.float32, state, **gathers)  # no gather to overlap
    sharded, sharded_bytes = run(True, torch.float32, state, **options)
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(sharded, plain, strict=True))
    groups = (state.intra_dp_cp.ranks, state.inter_dp_cp.ranks)
    mp_state.destroy()
    dist.barrier()
    return {"error": error, "plain": plain_bytes, "sharded": sharded_bytes, "groups": groups}


OPTIONS = {"sum": {}, "average-overlapped": {"average_in_collective": True,
                                             "overlap_grad_reduce": True,
                                             "overlap_param_gather": True}}  # fmt: skip


@pytest.mark.parametrize("options", list(OPTIONS))
def test_two_instances_equal_plain_with_half_of_the_state(options):
    """DP4 in two instances: each rank shards over its pair ((0, 1) or (2, 3)), whose
    shards ranks 2 apart hold again; the reduce-scatter in the pair and the all-reduce
    across the pairs give the plain optimizer's update (a sum, or averages in the
    collectives with the reductions overlapped), with half of the state per rank."""
    results = run_on_ranks(instances_body, 4, OPTIONS[options], timeout=120)
    for rank, r in enumerate(results):
        assert r["groups"] == ((0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2))
        assert r["error"] < 1e-6, f"rank {rank}: parameters differ by {r['error']:.2e}"
        ratio = r["sharded"] / (r["plain"] / 2)
        assert 0.95 <= ratio <= 1.05, (
            f"rank {rank}: {r['sharded']} bytes of optimizer state against "
            f"{r['plain']} / 2 unsharded (ratio {ratio:.3f})"
        )
