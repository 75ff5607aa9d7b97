"""The test processes' own settings (conftest.py). Under pytest-xdist a worker computes
with its share of the cores: two workers on two cores, one torch thread each, not a
thread per core in both. DCP's call logger makes no DEBUG records. torch.compile's
caches are the run's own. The test processes, and the processes they start, run under
SCHED_BATCH."""

import os
import subprocess
import sys

import pytest
import torch


def test_a_worker_has_its_share_of_the_cores():
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        pytest.skip("runs only under pytest-xdist (-n)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert torch.get_num_threads() == max(1, cores // int(workers))


def test_dcp_call_records_below_info_are_not_made():
    """conftest.py raises DCP's call logger to INFO: its DEBUG records of every save and
    load were formatted by pytest's capture handlers."""
    import logging

    from torch.distributed.checkpoint.logger import _dcp_logger

    assert not _dcp_logger.isEnabledFor(logging.DEBUG)


def test_compile_caches_are_the_runs_own(tmp_path_factory):
    """Inductor's cache (and Triton's) in the run's base temporary folder, shared by
    xdist's workers: not torch's default in /tmp, warm from other runs and left behind."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent
    assert cache_dir() == str(run / "inductor")
    assert triton_cache_dir(0) == str(run / "triton")


def _scheduling_policy() -> int:
    return os.sched_getscheduler(0)


@pytest.mark.multirank
def test_the_tests_and_the_processes_they_start_run_under_sched_batch():
    """conftest.py: the test process, a rank forked from it and a fresh subprocess run
    under SCHED_BATCH, where gloo's loop thread does not preempt its rank's lock holder."""
    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("SCHED_BATCH is Linux's")
    setting = os.environ.get("MP_TEST_BATCH_SCHEDULING", "1")
    if setting != "1":
        pytest.skip(f"MP_TEST_BATCH_SCHEDULING={setting}: the default policy")
    from mp_state.testing import run_on_ranks

    assert _scheduling_policy() == os.SCHED_BATCH
    assert run_on_ranks(_scheduling_policy, 2) == [os.SCHED_BATCH] * 2
    child = "import os; print(os.sched_getscheduler(0))"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert int(out.stdout) == os.SCHED_BATCH, out.stderr
