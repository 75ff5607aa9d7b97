"""The test processes' own settings (conftest.py). Under pytest-xdist a worker computes
with its share of the cores: two workers on two cores, one torch thread each, not a
thread per core in both. DCP's call logger makes no DEBUG records. torch.compile's
caches are the run's own."""

import os

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
