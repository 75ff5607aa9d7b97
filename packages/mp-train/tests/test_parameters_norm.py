"""parameters_norm counts every logical element once: dense parameters replicated on the
data-parallel ranks, expert parameters split over the expert-parallel ones."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks
from mp_train.observability.metrics import parameters_norm

pytestmark = pytest.mark.multirank


def norm_body():
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(expert_model_parallel_size=2))
    module = torch.nn.Module()
    module.dense = torch.nn.Parameter(torch.full((3,), 2.0))  # the same on both ranks
    module.experts = torch.nn.Parameter(torch.full((4,), float(state.ep.rank + 1)))
    module.experts.expert_parallel = True
    run = SimpleNamespace(
        model=[SimpleNamespace(module=module)], state=state, device=torch.device("cpu"),
        optimizer=SimpleNamespace(expert_mp_group=state.tp_ep_pp),
    )  # fmt: skip
    norm = parameters_norm(run)
    mp_state.destroy()
    dist.barrier()
    return norm


def test_parameters_norm_with_expert_parallel_parameters():
    want = (3 * 2.0**2 + 4 * 1.0**2 + 4 * 2.0**2) ** 0.5
    assert run_on_ranks(norm_body, 2, timeout=60) == [pytest.approx(want)] * 2
