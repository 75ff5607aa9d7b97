"""Under pytest-xdist a worker computes with its share of the cores (conftest.py): two
workers on two cores, one torch thread each, not a thread per core in both."""

import os

import pytest
import torch


def test_a_worker_has_its_share_of_the_cores():
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        pytest.skip("runs only under pytest-xdist (-n)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert torch.get_num_threads() == max(1, cores // int(workers))
