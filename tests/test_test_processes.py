"""The test processes' own settings (conftest.py). Under pytest-xdist a worker computes
with its share of the cores: two workers on two cores, one torch thread each, not a
thread per core in both. DCP's call logger makes no DEBUG records."""

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
