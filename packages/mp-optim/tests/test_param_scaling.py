"""scale_rows (QK-clip's update) scales a parameter's rows in the model and in the
optimizer's fp32 main parameters (a bf16 model: copies), plain and distributed over two
ranks (each rank's flat range of the rows): exactly the factors of each main element's
row, and the next step starts from them (a run whose main parameters were left alone
would come back to the unscaled weights)."""

import pytest
import torch

import mp_state
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer, scale_rows
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def two_steps(distributed: bool, scaled: bool, state) -> dict:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).bfloat16()
    config = OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=distributed,
                             bucket_size=100)  # fmt: skip
    model = DistributedDataParallel(config, module, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    weight = module[0].weight
    rows = torch.linspace(0.25, 1.0, 32)
    factors = rows[:, None].expand(32, 16).reshape(-1)
    generator = torch.Generator().manual_seed(3 + state.dp.rank)
    exact = True
    for step in range(2):
        optimizer.zero_grad()
        x = torch.randn(4, 16, generator=generator).bfloat16()
        model(x).float().square().mean().backward()
        model.finish_grad_sync()
        assert optimizer.step().update_successful
        if step == 0 and scaled:
            shards = optimizer.shards[weight]
            before = [s.main_param.clone() for s in shards]
            model_before = weight.detach().clone()
            scale_rows(optimizer, weight, rows)
            for shard, old in zip(shards, before, strict=True):
                assert not shard.aliased
                part = factors[shard.start : shard.start + old.numel()].view_as(old)
                exact &= torch.equal(shard.main_param, old * part)
            exact &= torch.equal(weight.detach(), (model_before.float() * rows[:, None]).bfloat16())
    return {"weight": weight.detach().float().clone(), "exact": exact}


def body():
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    return {distributed: (two_steps(distributed, True, state), two_steps(distributed, False, state))
            for distributed in (False, True)}  # fmt: skip


def test_scaled_rows_reach_the_main_parameters():
    for results in run_on_ranks(body, 2, timeout=120):
        for distributed, (scaled, plain) in results.items():
            assert scaled["exact"], distributed
            # the step after starts from the scaled rows: the smallest factor, 0.25, stays
            ratio = scaled["weight"][0].norm() / plain["weight"][0].norm()
            assert 0.2 < ratio < 0.35, (distributed, ratio)
            assert torch.allclose(scaled["weight"][-1], plain["weight"][-1], atol=2e-2)
        torch.testing.assert_close(results[True][0]["weight"], results[False][0]["weight"],
                                   rtol=0, atol=1e-2)  # fmt: skip
