"""A run whose loaders read with worker processes leaves none behind, even when it
raises: pretrain closes its data iterators itself, so no worker outlives the run and no
multi-process DataLoader iterator waits for the garbage collector (whose finalizer, run
by whatever code the collection interrupts, waits on locks it shares with the workers).
A run that returns is the easy case (its iterators die with its frame); one that raises
leaves its frame, iterators included, in the traceback its caller holds."""

import pytest

from mp_gpt.testing import tiny_options
from mp_state.testing import run_on_ranks


def body(run_dir) -> tuple[int, tuple[int, int]]:
    import gc
    import multiprocessing
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    # multiprocessing forbids a daemonic process (a launcher's rank) children, the loaders'
    # workers; the launcher ends the rank with os._exit either way.
    multiprocessing.current_process().daemon = False
    from mp_gpt.gpt import datasets_provider, forward_step, model_provider
    from mp_train import parse_config, pretrain

    seen = []

    def step(data_iterator, model):
        if len(seen) == 2:  # iteration 2's, after iteration 1 and its evaluation
            raise RuntimeError("a failing step")
        seen.append(len(multiprocessing.active_children()))
        return forward_step(data_iterator, model)

    options = tiny_options(run_dir, "--num-workers", "2", "--train-iters", "2",
                           "--global-batch-size", "1", "--eval-interval", "1",
                           "--eval-iters", "1")  # fmt: skip
    try:
        pretrain(parse_config(options), model_provider=model_provider,
                 datasets_provider=datasets_provider, forward_step_func=step)  # fmt: skip
    except RuntimeError as error:
        held = error  # its traceback holds the run's frames, as a test's raises() does
        assert str(held) == "a failing step"
        iterators = [o for o in gc.get_objects()
                     if type(o).__name__ == "_MultiProcessingDataLoaderIter"]  # fmt: skip
        return max(seen), (len(multiprocessing.active_children()), len(iterators))
    raise AssertionError("the run did not raise")


@pytest.mark.multirank
def test_a_run_that_raises_leaves_no_loader_worker_or_iterator(tmp_path):
    workers, left = run_on_ranks(body, 1, tmp_path, timeout=120)[0]
    assert workers >= 4, workers  # the train and valid loaders' two each were running
    assert left == (0, 0), left  # (live child processes, reachable iterators)
