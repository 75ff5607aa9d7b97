"""DP = 2 and 4 with DDP over k steps equal one process on the global batch
(each parameter tensor within 1e-6 relative: |got - want| / |want| in L2).

Every combination of overlap_grad_reduce, the distributed optimizer and
gradient accumulation over micro-batches; buckets small enough that several
exist and parameters are cut between distributed-optimizer shards.
"""

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_optim import DistributedDataParallel, OptimizerConfig, get_optimizer
from mp_state import ParallelConfig, RankGroup
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

GLOBAL_BATCH, STEPS = 8, 3
SINGLE = RankGroup("single", (0,), 0, None)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 40), torch.nn.LayerNorm(40), torch.nn.GELU(),
        torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5),
    )  # fmt: skip
    return model


def batches():
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield (
            torch.randn(GLOBAL_BATCH, 12, generator=generator),
            torch.randn(GLOBAL_BATCH, 5, generator=generator),
        )


def train(config: OptimizerConfig, dp_group: RankGroup, micro_batches: int) -> list[torch.Tensor]:
    """STEPS steps; this dp rank takes its slice of each global batch in micro_batches parts."""
    model = DistributedDataParallel(config, make_model(), dp_group=dp_group)
    optimizer = get_optimizer(config, [model], mp_group=SINGLE)
    for x, y in batches():
        x, y = x.chunk(dp_group.size)[dp_group.rank], y.chunk(dp_group.size)[dp_group.rank]
        optimizer.zero_grad()
        parts = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
        for i, (xm, ym) in enumerate(parts):
            sync = i == len(parts) - 1
            with model.no_sync() if not sync else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(xm), ym) / micro_batches
                loss.backward()
        model.finish_grad_sync()
        result = optimizer.step()
        assert result.update_successful
    return [p.detach().clone() for p in model.module.parameters()]


def config_for(overlap: bool, distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(
        lr=1e-2, weight_decay=0.1, clip_grad=0.5, overlap_grad_reduce=overlap,
        use_distributed_optimizer=distributed, bucket_size=300,
    )  # fmt: skip


CASES = list(itertools.product((False, True), (False, True), (1, 2)))


def dp_body(cases):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig())
    worst = {}
    want = train(config_for(False, False), SINGLE, 1)
    for overlap, distributed, micro in cases:
        got = train(config_for(overlap, distributed), state.dp, micro)
        worst[(overlap, distributed, micro)] = max(
            float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)
        )
    mp_state.destroy()
    dist.barrier()
    return worst


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_equals_one_process(dp):
    results = run_on_ranks(dp_body, dp, CASES, timeout=120)
    for rank, worst in enumerate(results):
        for case, error in worst.items():
            overlap, distributed, micro = case
            assert error < 1e-6, (
                f"rank {rank}, overlap={overlap}, distributed={distributed}, "
                f"micro_batches={micro}: parameters differ by {error:.2e} relative"
            )


def test_parameters_moved():
    """The comparison above is not vacuous: the steps change the parameters."""
    before = [p.detach().clone() for p in make_model().parameters()]
    after = train(config_for(False, False), SINGLE, 1)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(after, before, strict=True))
