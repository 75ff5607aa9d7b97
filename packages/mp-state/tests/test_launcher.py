"""The multi-rank launcher: results, failures, deaths and hangs, never a hung test."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mp_state.testing import RankFailure, RankTimeout, default_start_method, run_on_ranks

pytestmark = pytest.mark.multirank


def rank_and_sum(offset: int) -> tuple[int, int, str]:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()), os.environ["LOCAL_RANK"]


def test_returns_each_ranks_result_in_rank_order():
    results = run_on_ranks(rank_and_sum, 4, 10)
    assert results == [(r, 0 + 1 + 2 + 3 + 40, str(r)) for r in range(4)]


def test_matmul_in_a_forked_rank_after_one_in_the_parent():
    # The parent's thread pool is busy before the fork; children must not hang on it.
    a = torch.randn(256, 256)
    (a @ a).sum()

    def matmul():
        b = torch.randn(256, 256)
        return float((b @ b).abs().sum() > 0)

    assert run_on_ranks(matmul, 2, timeout=60) == [1.0, 1.0]


def test_a_progress_bar_lock_held_in_the_parent_does_not_stop_a_forked_rank():
    # tqdm's monitor thread takes the bars' locks every few seconds; a rank forked then
    # (or after a sibling died holding the shared one) must still make its bars.
    import threading

    tqdm = pytest.importorskip("tqdm")
    held, done = threading.Event(), threading.Event()

    def hold():
        with tqdm.tqdm.get_lock():
            held.set()
            done.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(30)

    def bar():
        with tqdm.tqdm(total=2, file=io.StringIO()) as progress:
            progress.update(2)
        return progress.n

    try:
        assert run_on_ranks(bar, 2, timeout=60) == [2, 2]
    finally:
        done.set()
        holder.join(30)


def test_inductors_compile_pool_from_the_parent_does_not_stop_a_forked_rank():
    # A test process that compiled in-process with several compile threads holds
    # inductor's ThreadPoolExecutor (AsyncCompile.pool), whose threads a forked rank does
    # not have: a rank's compile, or its load of a kernel from the cache, submitted to it
    # and waited forever (seen in test_train_precision_aware.py's compiled case).
    # The setting goes through inductor's own patch(): pytest's monkeypatch undoes it by
    # deleting the attribute, which hides it in torch's config module for the rest of the
    # worker process, so that a later compile there, or in a rank it forks, failed with
    # "torch._inductor.config.compile_threads does not exist".
    import torch._inductor.config
    from torch._inductor.async_compile import AsyncCompile

    threads = torch._inductor.config.compile_threads
    AsyncCompile.pool.cache_clear()  # a pool of this test's own, made below
    try:
        with torch._inductor.config.patch(compile_threads=2):
            assert AsyncCompile.pool().submit(lambda: 1).result(timeout=30) == 1  # idle

            def compile_job():
                return AsyncCompile.pool().submit(lambda: 2).result(timeout=10)

            assert run_on_ranks(compile_job, 1, timeout=60) == [2]
    finally:
        AsyncCompile.pool().shutdown()
        AsyncCompile.pool.cache_clear()
    assert torch._inductor.config.compile_threads == threads  # restored, and readable


def raise_on_rank_2():
    if dist.get_rank() == 2:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # the other ranks wait for rank 2, which never arrives


def test_a_rank_that_raises_fails_the_run_quickly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(raise_on_rank_2, 4, timeout=60)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert message.startswith("rank 2 of 4 failed:")
    assert "ValueError: bad shard on purpose" in message
    assert "in raise_on_rank_2" in message
    assert 2 in info.value.failures


def hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return "done"


def test_a_rank_that_hangs_times_out_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(hang_on_rank_1, 2, timeout=4)
    elapsed = time.monotonic() - start
    assert elapsed < 15, elapsed
    message = str(info.value)
    assert "rank(s) 1 of 2 still running after 4 s (rank(s) 0 returned)" in message
    # The stack shows where rank 1 was stuck.
    assert "hang_on_rank_1" in info.value.failures[1]


def die_on_rank_0():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankFailure, match="rank 0 was killed by SIGKILL"):
        run_on_ranks(die_on_rank_0, 2, timeout=60)


def test_an_unpicklable_result_is_an_error_naming_the_rank():
    with pytest.raises(RankFailure, match=r"rank 0 of 1 failed:(.|\n)*pickle"):
        run_on_ranks(lambda: lambda: None, 1)


def test_without_a_process_group():
    def check():
        return dist.is_initialized(), os.environ["WORLD_SIZE"], os.environ["MP_DEVICE"]

    # CPU ranks by default: MP_DEVICE=cpu in each (mp_state.devices reads it).
    expected = [(False, "2", "cpu")] * 2
    assert run_on_ranks(check, 2, init_process_group=False) == expected


def test_spawned_ranks_work_too():
    # Spawn pickles the function: take one that any fresh interpreter can import.
    assert run_on_ranks(dist.get_rank, 2, start_method="spawn", timeout=120) == [0, 1]


def test_world_size_must_be_positive_and_the_device_known(monkeypatch):
    with pytest.raises(ValueError, match="world_size=0"):
        run_on_ranks(dist.get_rank, 0)
    with pytest.raises(ValueError, match="device='tpu': expected cpu or cuda"):
        run_on_ranks(dist.get_rank, 1, device="tpu")
    # CPU ranks fork (even after this process used CUDA); CUDA ranks must be spawned.
    monkeypatch.delenv("MP_TEST_START_METHOD", raising=False)
    assert default_start_method("cuda") == "spawn"
    if sys.platform == "linux":
        assert default_start_method() == "fork"


RANKS_WITH_A_FOLDER = """
import multiprocessing.util
from mp_state.testing import run_on_ranks
# each rank makes multiprocessing's folder (a loader worker's socket would go there)
folders = run_on_ranks(multiprocessing.util.get_temp_dir, 2, init_process_group=False)
assert folders == [multiprocessing.util.get_temp_dir()] * 2, folders
"""


def test_ranks_leave_no_temporary_folder_behind(tmp_path):
    """A rank ends with os._exit, which removes nothing: its ranks use the caller's
    multiprocessing folder, which goes when the caller exits."""
    env = os.environ | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", RANKS_WITH_A_FOLDER], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.glob("pymp-*"))  # (torch's compiler makes a cache folder)
