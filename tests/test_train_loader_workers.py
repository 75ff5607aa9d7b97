"""A run whose loaders read with worker processes leaves none behind when it returns or
raises: pretrain closes its data iterators itself, so no worker outlives the run and no
multi-process DataLoader iterator waits for the garbage collector (whose finalizer, run
by whatever code the collection interrupts, waits on locks it shares with the workers)."""

import pytest

from mp_gpt.testing import tiny_options
from mp_state.testing import run_on_ranks


def body(run_dir) -> dict:
    import gc
    import multiprocessing
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    # multiprocessing forbids a daemonic process (a launcher's rank) children, the loaders'
    # workers; the launcher ends the rank with os._exit either way.
    multiprocessing.current_process().daemon = False
    import mp_state
    from mp_gpt.gpt import datasets_provider, forward_step, model_provider
    from mp_train import parse_config, pretrain

    def left() -> tuple[int, int]:
        """(live child processes, multi-process DataLoader iterators reachable)."""
        iterators = [o for o in gc.get_objects()
                     if type(o).__name__ == "_MultiProcessingDataLoaderIter"]  # fmt: skip
        return len(multiprocessing.active_children()), len(iterators)

    def run(fail_at: int | None):
        """Trains 2 iterations with an evaluation after each; the forward step numbered
        `fail_at` raises. Returns (the most live workers a step saw, what the run left)."""
        seen = []

        def step(data_iterator, model):
            if len(seen) + 1 == fail_at:
                raise RuntimeError("a failing step")
            seen.append(len(multiprocessing.active_children()))
            return forward_step(data_iterator, model)

        options = tiny_options(run_dir, "--num-workers", "2", "--train-iters", "2",
                               "--eval-interval", "1", "--eval-iters", "1")  # fmt: skip
        try:
            pretrain(parse_config(options), model_provider=model_provider,
                     datasets_provider=datasets_provider, forward_step_func=step)  # fmt: skip
        except RuntimeError as error:
            held = error  # its traceback holds the run's frames, as a test's raises() does
            assert str(held) == "a failing step"
            found = left()
        else:
            found = left()
        mp_state.destroy()
        return max(seen), found

    return {"returned": run(None), "raised": run(fail_at=10)}


@pytest.mark.multirank
def test_a_run_leaves_no_loader_worker_or_iterator_when_it_returns_or_raises(tmp_path):
    runs = run_on_ranks(body, 1, tmp_path, timeout=120)[0]
    for how, (workers, left) in runs.items():
        assert workers >= 4, (how, workers)  # the train and valid loaders' two each ran
        assert left == (0, 0), (how, left)  # (live children, reachable iterators)
