"""broadcast_data from TP rank 0, and dropout on the tensor-parallel random stream.

Shapes: [b, s] batches of token ids; [s, b, h] activations.
"""

import pytest
import torch

import mp_state
from mp_layers.tensor_parallel import broadcast_data, tensor_parallel_dropout
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

KEYS = ["tokens", "labels", "loss_mask", "empty"]


def batch_of(global_rank: int) -> dict[str, torch.Tensor]:
    """A batch that names the rank it was made on."""
    tokens = torch.arange(10, dtype=torch.int64).view(2, 5) + 100 * global_rank
    return {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.full((3,), global_rank, dtype=torch.int64),
        "empty": torch.zeros(2, 0, dtype=torch.int64),
    }


def receive(tp: int):
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=tp))
    data = batch_of(state.rank) if state.tp.rank == 0 else None
    got = broadcast_data(KEYS, data, torch.int64, state.tp)
    mp_state.destroy()
    return state.tp.ranks[0], got


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_broadcast_data_delivers_tp_rank_0s_tensors(tp):
    # World size 4: with tp = 2 there are two TP groups, each with its own source.
    for rank, (src, got) in enumerate(run_on_ranks(receive, 4, tp, timeout=60)):
        assert src == rank - rank % tp
        expected = batch_of(src)
        assert list(got) == KEYS
        for key in KEYS:
            assert got[key].dtype == torch.int64
            assert torch.equal(got[key], expected[key]), (tp, rank, key)


def wrong_dtype():
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=1))
    with pytest.raises(ValueError, match=r"data\['tokens'\].dtype=torch.int64"):
        broadcast_data(["tokens"], batch_of(0), torch.float32, state.tp)
    with pytest.raises(ValueError, match="'missing'"):
        broadcast_data(["missing"], batch_of(0), torch.int64, state.tp)
    mp_state.destroy()


def test_broadcast_data_checks_rank_0s_data():
    run_on_ranks(wrong_dtype, 1, timeout=60)


def masks():
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
    tracker = mp_state.set_random_seeds(1234, state)
    x = torch.ones(4, 2, 64)
    saved = tracker.get_states()
    default_before = torch.get_rng_state()
    first = tensor_parallel_dropout(x, 0.5, tracker)
    # The default generator, which the TP ranks share, has not moved.
    assert torch.equal(torch.get_rng_state(), default_before)
    second = tensor_parallel_dropout(x, 0.5, tracker)
    assert not torch.equal(first, second)  # the stream advances
    tracker.set_states(saved)
    replayed = tensor_parallel_dropout(x, 0.5, tracker)
    assert torch.equal(replayed, first)  # restored states reproduce the mask
    assert tensor_parallel_dropout(x, 0.5, tracker, training=False) is x
    mp_state.destroy()
    return first != 0


def test_tensor_parallel_dropout_differs_per_tp_rank_and_replays():
    rank0, rank1 = run_on_ranks(masks, 2, timeout=60)
    assert not torch.equal(rank0, rank1)
    # Each mask keeps about half the elements (p = 0.5).
    for mask in (rank0, rank1):
        assert 0.3 < mask.float().mean().item() < 0.7
