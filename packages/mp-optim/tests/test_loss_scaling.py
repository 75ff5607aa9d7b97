"""fp16 loss scaling: growth, backoff with hysteresis, and steps skipped on every rank."""

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_optim import (
    ConstantGradScaler,
    DistributedDataParallel,
    DynamicGradScaler,
    OptimizerConfig,
    get_optimizer,
)
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks


def test_growth_after_the_window():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)  # third clean step
    assert scaler.scale == 16.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 32.0


def test_backoff_after_hysteresis_and_min_scale():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    scaler.update(True)
    assert scaler.scale == 8.0  # the first overflow is tolerated
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(True)  # hysteresis spent: every further overflow halves
    assert scaler.scale == 2.0
    scaler.update(True)
    assert scaler.scale == 2.0  # never below min_scale


def test_overflow_restarts_the_clean_count_and_growth_refills_hysteresis():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=2, hysteresis=2)
    scaler.update(False)
    scaler.update(True)  # clean count back to 0, hysteresis 2 -> 1
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)  # two clean steps since the overflow
    assert scaler.scale == 16.0
    scaler.update(True)  # hysteresis refilled by the growth: tolerated
    assert scaler.scale == 16.0
    restored = DynamicGradScaler(1.0, 1.0, growth_interval=2, hysteresis=2)
    restored.load_state_dict(scaler.state_dict())
    restored.update(True)
    assert restored.scale == 8.0


def test_constant_scaler_and_validation():
    scaler = ConstantGradScaler(128.0)
    scaler.update(True)
    assert scaler.scale == 128.0 and scaler.inv_scale == 1 / 128
    with pytest.raises(ValueError, match="loss_scale=0"):
        ConstantGradScaler(0)
    with pytest.raises(ValueError, match="hysteresis=0"):
        DynamicGradScaler(8.0, 1.0, hysteresis=0)


def fp16_body(bad_rank: int, value: float, before_reduction: bool, distributed: bool):
    """World 4 = tp 2 x dp 2; rank `bad_rank` gets a non-finite gradient."""
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(tensor_model_parallel_size=2))
    config = OptimizerConfig(
        lr=0.1, fp16=True, initial_loss_scale=1024.0, hysteresis=1, loss_scale_window=2,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    torch.manual_seed(0)
    module = torch.nn.Linear(16, 12).half()  # 204 elements: both dp shards own some
    model = DistributedDataParallel(config, module, dp_group=state.dp)
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    results = []
    for step in range(3):
        optimizer.zero_grad()
        before = [p.detach().clone() for p in module.parameters()]
        x = torch.ones(2, 16, dtype=torch.half)
        optimizer.scale_loss(model(x).float().sum() * 1e-3).backward()
        bad = step == 1 and dist.get_rank() == bad_rank
        if bad and before_reduction:
            module.weight.main_grad[0, 0] = value
        model.finish_grad_sync()
        if bad and not before_reduction:
            # An element this rank updates (its own shard with the distributed optimizer).
            optimizer.shards[module.weight][0].grad_view.view(-1)[0] = value
        scale = optimizer.get_loss_scale()
        result = optimizer.step()
        moved = any(not torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
        results.append((result.update_successful, moved, scale, optimizer.get_loss_scale()))
    mp_state.destroy()
    dist.barrier()
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
@pytest.mark.parametrize(
    "bad_rank,value,before_reduction",
    [(3, float("inf"), False), (1, float("nan"), False), (2, float("inf"), True)],
    ids=["inf-after-reduction", "nan-after-reduction", "inf-before-reduction"],
)
def test_one_bad_rank_skips_the_step_everywhere(bad_rank, value, before_reduction, distributed):
    results = run_on_ranks(fp16_body, 4, bad_rank, value, before_reduction, distributed)
    for rank, steps in enumerate(results):
        assert steps[0] == (True, True, 1024.0, 1024.0), f"rank {rank}: {steps[0]}"
        assert steps[1] == (False, False, 1024.0, 512.0), f"rank {rank}: {steps[1]}"
        assert steps[2] == (True, True, 512.0, 512.0), f"rank {rank}: {steps[2]}"
