"""initialize(): at once, or later under lazy_mpu_init once the caller has started
torch.distributed (here mp_state.testing's launcher plays the external manager)."""

import pytest

from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _config(lazy: bool):
    from mp_train import parse_config

    return parse_config([
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1",
        "--vocab-size", "64", "--mock-data", "--tensor-model-parallel-size", "2",
        *(["--lazy-mpu-init"] if lazy else []),
    ])  # fmt: skip


def _body(lazy: bool):
    import torch.distributed as dist

    import mp_state
    from mp_train import Initialized, initialize

    config = _config(lazy)
    launcher_group = dist.group.WORLD
    out = initialize(config)
    if lazy:
        assert callable(out) and not isinstance(out, Initialized)
        with pytest.raises(RuntimeError, match="mp_state is not initialized"):
            mp_state.current()  # nothing was set up yet
        out = out()
    assert isinstance(out, Initialized)
    assert dist.group.WORLD is launcher_group  # the caller's process group is kept
    assert mp_state.current() is out.state
    return out.state.tp.size, out.sizes["data_parallel_size"]


@pytest.mark.parametrize("lazy", [False, True], ids=["now", "lazy"])
def test_initialize_now_or_lazily(lazy):
    assert run_on_ranks(_body, 4, lazy, timeout=120) == [(2, 2)] * 4
