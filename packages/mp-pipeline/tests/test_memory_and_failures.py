"""1F1B's activation memory bound, and a rank that raises inside a schedule.

Memory is measured by counting the bytes of the tensors autograd keeps for
the backward (saved_tensors_hooks) that are alive at once, in units of one
micro-batch's: stage 0 of a p-stage 1F1B holds p micro-batches, no
pipelining holds 1, whatever the number of micro-batches.
"""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mp_state
from mp_pipeline import PipelineConfig, forward_backward_no_pipelining, get_forward_backward_func
from mp_pipeline.testing import TanhStack
from mp_state import ParallelConfig
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

S, B, H, LAYERS_PER_STAGE = 16, 4, 32, 2


class LiveSavedBytes:
    """saved_tensors_hooks that track the bytes of saved tensors still alive."""

    def __init__(self):
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, tensor):
        return _Held(tensor, self)


class _Held:
    def __init__(self, tensor, counter):
        self.tensor, self.counter = tensor, counter
        self.size = tensor.numel() * tensor.element_size()
        counter.live += self.size
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.size


def make_stage(first: bool) -> TanhStack:
    return TanhStack((torch.nn.Linear(H, H) for _ in range(LAYERS_PER_STAGE)), first)


def forward_step(data_iterator, model):
    x = next(data_iterator)
    return model(x), lambda out: (out.square().mean(), {})


def data(m):
    return iter([torch.randn(S, B, H) for _ in range(m)])


def one_microbatch_bytes(module, with_loss: bool) -> int:
    """Saved bytes of one micro-batch through `module` (and the loss, on a last stage)."""
    counter = LiveSavedBytes()
    with counter.hooks():
        out = module(torch.randn(S, B, H))
        (out.square().mean() if with_loss else out.sum()).backward()
    return counter.peak


def memory_body(p: int, m: int):
    torch.set_num_threads(1)
    state = mp_state.initialize(ParallelConfig(pipeline_model_parallel_size=p))
    torch.manual_seed(0)
    stage = make_stage(first=state.pp.rank == 0)
    config = PipelineConfig(seq_length=S, micro_batch_size=B, hidden_size=H)
    counter = LiveSavedBytes()
    with counter.hooks():
        get_forward_backward_func(p)(
            forward_step_func=forward_step, data_iterator=data(m), model=stage,
            num_microbatches=m, config=config, pp_group=state.pp,
        )  # fmt: skip
    unit = one_microbatch_bytes(stage, with_loss=False) if state.pp.rank == 0 else None
    mp_state.destroy()
    dist.barrier()
    return counter.peak, unit


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_stage_0_holds_p_microbatches(p, m):
    peak, unit = run_on_ranks(memory_body, p, p, m, timeout=120)[0]
    assert peak == p * unit, f"stage 0 held {peak / unit:.2f} micro-batches, expected {p}"


def test_no_pipelining_holds_one_microbatch():
    torch.manual_seed(0)
    stage = make_stage(first=True)
    counter = LiveSavedBytes()
    with counter.hooks():
        forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=data(8), model=stage,
            num_microbatches=8, config=PipelineConfig(),
        )  # fmt: skip
    assert counter.peak == one_microbatch_bytes(stage, with_loss=True)


def failing_body(bad_rank: int, group_timeout_s: float, hang: bool = False):
    """Every rank returns (what it raised, seconds from the start to the error).

    Each rank joins a world of its own making with a short group timeout: the
    test launcher's own would stop the run at the first error, hiding whether
    the other ranks fail by themselves."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.environ["MP_FAIL_STORE"], 4)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=4,
                            timeout=timedelta(seconds=group_timeout_s))  # fmt: skip
    state = mp_state.initialize(ParallelConfig(pipeline_model_parallel_size=4))
    stage = make_stage(first=state.pp.rank == 0)
    calls = 0

    def forward_step_failing(data_iterator, model):
        nonlocal calls
        calls += 1
        if state.pp.rank == bad_rank and calls == 3:
            if hang:
                time.sleep(2 * group_timeout_s)
            raise RuntimeError("injected failure in forward_step")
        return forward_step(data_iterator, model)

    config = PipelineConfig(seq_length=S, micro_batch_size=B, hidden_size=H,
                            p2p_timeout_s=group_timeout_s)  # fmt: skip
    start = time.monotonic()
    try:
        get_forward_backward_func(4)(
            forward_step_func=forward_step_failing, data_iterator=data(8), model=stage,
            num_microbatches=8, config=config, pp_group=state.pp,
        )  # fmt: skip
        outcome = "finished"
    except Exception as error:  # what each rank saw is the result
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    elapsed = time.monotonic() - start
    # As a process that exits would: close this rank's connections (no barrier first,
    # which mp_state.destroy would do), so that its peers see it gone.
    dist.destroy_process_group()
    return outcome, elapsed


def test_a_rank_that_raises_fails_every_rank_within_the_group_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_FAIL_STORE", str(tmp_path / "store"))
    results = run_on_ranks(failing_body, 4, 2, 5.0, timeout=60, init_process_group=False)
    for rank, (outcome, elapsed) in enumerate(results):
        assert outcome != "finished", f"rank {rank} finished a schedule another rank left"
        # Within the group timeout, give or take a loaded machine's delays: under twice it.
        assert elapsed < 2 * 5.0, f"rank {rank} took {elapsed:.1f} s to fail"
    assert "injected failure" in results[2][0]


def test_a_rank_that_hangs_makes_its_peers_fail_at_the_group_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_FAIL_STORE", str(tmp_path / "store"))
    results = run_on_ranks(failing_body, 4, 2, 3.0, True, timeout=60, init_process_group=False)
    for rank, (outcome, _) in enumerate(results):
        assert outcome != "finished", f"rank {rank} finished a schedule another rank left"
    assert "timed out after 3 s" in results[3][0], results[3]
    # The neighbours of the hanging rank give up at the 3 s group timeout, not later (a
    # second wait would take twice that); a loaded machine may add a few seconds.
    assert 2.5 < results[3][1] < 2 * 3.0, results[3]
