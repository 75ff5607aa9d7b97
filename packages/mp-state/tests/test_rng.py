"""Seeds and the RNG tracker: fork, restore, nesting, per-rank streams, round trips."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mp_state import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    TENSOR_PARALLEL_RNG,
    ParallelConfig,
    RNGStatesTracker,
    destroy,
    get_rng_state,
    initialize,
    model_parallel_seeds,
    rng_state_kept,
    set_random_seeds,
    set_rng_state,
    stage_seed,
)
from mp_state.testing import run_on_ranks


def draws(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def tracker_with(**seeds: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker("cpu")
    for name, seed in seeds.items():
        tracker.add(name, seed)
    return tracker


def test_fork_draws_from_the_named_stream_and_continues_it():
    tracker = tracker_with(a=11)
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert torch.equal(torch.cat([first, second]), draws(11, 7))


def test_the_default_stream_is_unchanged_by_a_fork():
    tracker = tracker_with(a=11)
    torch.manual_seed(5)
    expected = torch.rand(6)
    torch.manual_seed(5)
    before = torch.rand(2)
    with tracker.fork("a"):
        torch.rand(100)
        torch.nn.functional.dropout(torch.ones(50), p=0.5)
    after = torch.rand(4)
    assert torch.equal(torch.cat([before, after]), expected)


def test_adding_a_stream_leaves_the_default_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    tracker_with(a=1, b=2)
    assert torch.equal(torch.rand(3), expected)


def test_nested_forks_of_different_streams_each_continue_their_own():
    tracker = tracker_with(outer=21, inner=22)
    with tracker.fork("outer"):
        x1 = torch.rand(2)
        with tracker.fork("inner"):
            y = torch.rand(3)
        x2 = torch.rand(2)
    assert torch.equal(torch.cat([x1, x2]), draws(21, 4))
    assert torch.equal(y, draws(22, 3))


def test_a_stream_cannot_be_nested_in_itself():
    tracker = tracker_with(a=1)
    with tracker.fork("a"):
        inner = tracker.fork("a")
        with pytest.raises(RuntimeError, match=r"fork\('a'\) is already active"):
            inner.__enter__()


def test_the_default_stream_is_restored_when_the_block_raises():
    tracker = tracker_with(a=1)
    torch.manual_seed(9)
    expected = torch.rand(2)
    torch.manual_seed(9)
    with pytest.raises(ZeroDivisionError), tracker.fork("a"):
        torch.rand(10)
        _ = 1 / 0
    assert torch.equal(torch.rand(2), expected)
    with tracker.fork("a"):  # the stream itself kept its progress
        assert torch.equal(torch.rand(2), draws(1, 12)[10:])


def test_states_round_trip():
    tracker = tracker_with(a=1, b=2)
    saved = tracker.get_states()
    with tracker.fork("a"):
        once = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = torch.rand(5)
    assert torch.equal(once, again)
    # The saved copy is not aliased to the live state.
    with tracker.fork("a"):
        torch.rand(1)
    assert torch.equal(tracker.get_states()["b"], saved["b"])
    assert not torch.equal(tracker.get_states()["a"], saved["a"])


def test_tracker_errors_name_the_stream_or_seed():
    tracker = tracker_with(a=1)
    with pytest.raises(ValueError, match="RNG state 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 for 'b' is already used by 'a'"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="'zz' was never added"), tracker.fork("zz"):
        pass
    with pytest.raises(KeyError, match=r"\['zz'\] were never added"):
        tracker.set_states({"zz": torch.get_rng_state()})
    tracker.reset()
    assert tracker.names == []


def test_megatron_seed_rules():
    assert stage_seed(1234, pp_rank=0) == 1234
    assert stage_seed(1234, pp_rank=3, dp_rank=2) == 1534
    assert stage_seed(1234, pp_rank=3, dp_rank=2, data_parallel_random_init=True) == 1554
    assert model_parallel_seeds(1534, tp_rank=1, ep_rank=2, etp_rank=1) == {
        DATA_PARALLEL_RNG: 1534,
        TENSOR_PARALLEL_RNG: 1534 + 2718 + 1,
        EXPERT_PARALLEL_RNG: 1534 + 1024 + 200 + 1,
    }
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match=f"seed={bad!r} must be a positive integer"):
            stage_seed(bad, pp_rank=0)


def test_full_rng_state_round_trips():
    tracker = tracker_with(a=3)
    saved = get_rng_state(tracker)

    def sample():
        with tracker.fork("a"):
            forked = torch.rand(2)
        return random.random(), np.random.rand(), torch.rand(2), forked

    first = sample()
    set_rng_state(saved, tracker)
    second = sample()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


def test_rng_state_kept_undoes_a_blocks_draws_even_when_it_raises():
    tracker = tracker_with(a=3)
    saved = get_rng_state(tracker)
    expected = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(saved, tracker)
    with pytest.raises(RuntimeError), rng_state_kept(tracker):
        random.random(), np.random.rand(), torch.rand(5)
        iter(torch.utils.data.DataLoader(range(4)))  # takes a base seed from torch
        with tracker.fork("a"):
            torch.rand(3)
        raise RuntimeError
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(2), expected[2])
    assert torch.equal(tracker.get_states()["a"], saved["tracker"]["a"])


def seeded_draws(data_parallel_random_init: bool) -> dict:
    state = initialize(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    tracker = set_random_seeds(1234, state, data_parallel_random_init=data_parallel_random_init)
    out = {"tp": state.tp.rank, "pp": state.pp.rank, "dp": state.dp.rank}
    out["tracker_device"] = str(tracker.device)
    out["python"] = random.random()
    out["numpy"] = float(np.random.rand())
    out["default"] = torch.rand(4)
    for name in (TENSOR_PARALLEL_RNG, DATA_PARALLEL_RNG, EXPERT_PARALLEL_RNG):
        with tracker.fork(name):
            out[name] = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    destroy()
    return out


@pytest.mark.multirank
def test_streams_per_rank_on_tp2_pp2_dp2():
    ranks = run_on_ranks(seeded_draws, 8, False)

    def same(a, b, key):
        x, y = ranks[a][key], ranks[b][key]
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    # Ranks 0 and 1: one TP group (same stage, same dp replica).
    assert ranks[0]["tp"] != ranks[1]["tp"]
    for key in ("python", "numpy", "default", DATA_PARALLEL_RNG):
        assert same(0, 1, key), key
    assert not same(0, 1, TENSOR_PARALLEL_RNG)
    assert not same(0, 1, EXPERT_PARALLEL_RNG)  # expert tp = tp by default
    # Ranks 0 and 4: the two pipeline stages of one pipeline.
    assert (ranks[0]["pp"], ranks[4]["pp"]) == (0, 1)
    for key in ("python", "numpy", "default", DATA_PARALLEL_RNG, TENSOR_PARALLEL_RNG):
        assert not same(0, 4, key), key
    # Ranks 0 and 2: data-parallel replicas draw alike unless asked otherwise.
    assert (ranks[0]["dp"], ranks[2]["dp"]) == (0, 1)
    for key in ("python", "default", TENSOR_PARALLEL_RNG):
        assert same(0, 2, key), key


@pytest.mark.multirank
def test_data_parallel_random_init_separates_replicas():
    ranks = run_on_ranks(seeded_draws, 8, True)
    assert not torch.equal(ranks[0]["default"], ranks[2]["default"])
    assert torch.equal(ranks[0]["default"], ranks[1]["default"])


@pytest.mark.cuda
def test_cpu_ranks_forked_from_a_process_that_uses_cuda():
    torch.ones(1, device="cuda").sum().item()  # CUDA initialized here
    ranks = run_on_ranks(seeded_draws, 8, False)  # forked: a rank touching CUDA would fail
    assert {r["tracker_device"] for r in ranks} == {"cpu"}
    assert not torch.equal(ranks[0][TENSOR_PARALLEL_RNG], ranks[1][TENSOR_PARALLEL_RNG])


@pytest.mark.cuda
def test_tracker_on_cuda(monkeypatch):
    tracker = RNGStatesTracker("cuda")
    tracker.add("a", 7)
    torch.cuda.manual_seed(3)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(3)
    with tracker.fork("a"):
        forked = torch.rand(4, device="cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    reference = torch.rand(4, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    assert torch.equal(forked, reference)
    # set_random_seeds drives the CUDA generator where the process computes on CUDA.
    one = SimpleNamespace(rank=0)
    state = SimpleNamespace(pp=one, dp=one, tp=one, ep=one, expert_tp=one)
    with rng_state_kept():  # the seeds it sets go no further than this test
        monkeypatch.setenv("MP_DEVICE", "cuda")
        cuda = torch.device("cuda", torch.cuda.current_device())
        assert set_random_seeds(5, state).device == cuda
        monkeypatch.setenv("MP_DEVICE", "cpu")
        assert set_random_seeds(5, state).device == torch.device("cpu")
