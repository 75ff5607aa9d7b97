"""The suite's device rule: a test runs on the CPU unless it is marked `cuda`.

This process, and through its environment every process a test starts (forked
ranks, torchrun jobs, command-line subprocesses), runs with MP_DEVICE=cpu, which
mp_state.devices reads: on a machine with a GPU the CPU tests stay on the CPU with
gloo, as they run on one without. A test marked `cuda` asks for the GPU itself
(run_on_ranks(device="cuda"), TorchrunJob(device="cuda"), MP_DEVICE=cuda for one
call) and is skipped where torch sees no CUDA device. docs/testing.md has the rules.

Bytecode for the processes the tests start: where the environment forbids writing it
(PYTHONDONTWRITEBYTECODE), every new Python process (a torchrun job's launcher and
workers, a command-line subprocess) would compile torch's and mp's modules from source
again, about 3 s each. Those processes instead write and read their bytecode under one
cache folder outside the repository (PYTHONPYCACHEPREFIX, in the temporary directory),
so the first compiles and the others reuse it; the source tree stays free of it.

The cyclic garbage collector is off while the tests are collected: importing them (torch,
transformers, every package) makes some million objects that live as long as the
process, and the collector would scan them over and over while they come, about 1 s of a
worker's CPU. They are then frozen out of later collections and the collector is on
again for the tests (the launcher unfreezes them at its first fork, as it does its own
freeze: mp_state.testing), and unfrozen at the end, where frozen objects would outlive
the interpreter's last collection (triton's bindings then report them as leaked).

Under pytest-xdist each worker computes with its share of the cores (cores // workers
torch threads, at least one): with torch's default, a thread per core in every worker,
two workers on two cores ran four compute threads, and each small operation's thread
team waited for a thread that was off running the other worker's test. The processes
the tests start choose their own (the forked ranks one thread each, torchrun jobs and
subprocesses OMP_NUM_THREADS=1).

DCP's call logger records nothing below INFO in the test processes. It logs every DCP
call at DEBUG (a dict of the call's arguments) to a logger that does not propagate, and
pytest attaches its capture handlers to such loggers too, so each save and load was
formatted three times over: about a quarter of the pytest time of the checkpoint tests
that call DCP most. The ranks forked from a test process inherit the level.

One compile cache for the run: torch.compile's kernels (Inductor's cache, and Triton's
on a GPU) go to a folder of the run's own (`inductor/` in pytest's base temporary folder,
which xdist's workers share), so every run compiles from a cold cache, as on a fresh
machine, and compiles each kernel once however many tests and ranks ask for it. Before,
three tests kept a cold folder each and the others used torch's default
(`/tmp/torchinductor_<user>`), warm from earlier runs on a developer's machine and cold
on a fresh one, which the suite filled and left behind (2.2 GB on one machine).

The test processes run under Linux's SCHED_BATCH policy (set here, inherited by every
thread and process started after: xdist's workers, forked ranks, torchrun jobs, command-line
subprocesses), which takes away a woken thread's right to preempt the running one. gloo's
TCP loop thread, woken by a peer's bytes, used to preempt the thread of its own rank that
had just written its part of the collective while still holding the pair's lock, then
spin in epoll_wait until that thread ran again: two forked ranks all-reducing 4 floats
took 1.0-1.2 ms and about 0.7 ms of CPU each (0.5-0.6 ms of it in the kernel), and
0.23-0.27 ms and 0.2 ms under SCHED_BATCH; four ranks 3.3 ms and 0.63 ms. Four of the
training test files (`-n 2`): 83 s and 82 s by pytest's count, 74 s and 73 s under
SCHED_BATCH, the two alternating. MP_TEST_BATCH_SCHEDULING=0 keeps the default policy;
where the system refuses SCHED_BATCH it is set to "refused" (the tests of the policy skip).

No progress-bar monitor thread: tqdm (transformers' save and load bars, torch.fx's
interpreter) would start one in a test process, and it takes the bars' locks every 10 s;
a rank or worker forked while it held them would wait forever at its first bar
(mp_state.testing's launcher also gives its ranks fresh locks).
"""

import gc
import logging
import os
import tempfile

import pytest

os.environ["MP_DEVICE"] = "cpu"
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault(
        "PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"mp-pycache-{os.getuid()}")
    )


def _batch_scheduling() -> None:
    if os.environ.get("MP_TEST_BATCH_SCHEDULING", "1") != "1" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a sandbox that forbids it: slower collectives, the same results
        os.environ["MP_TEST_BATCH_SCHEDULING"] = "refused"


_batch_scheduling()

try:
    import tqdm

    tqdm.tqdm.monitor_interval = 0
except ImportError:  # not installed: no bars, no monitor
    pass


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        torch.set_num_threads(worker_threads(workers))
    if workers or not getattr(config.option, "numprocesses", None):  # not xdist's controller
        _quiet_dcp_call_records()


def _quiet_dcp_call_records() -> None:
    import torch.distributed.checkpoint.logger as dcp_logging

    logger = getattr(dcp_logging, "_dcp_logger", None)  # tests/test_test_processes.py
    if logger is not None:
        logger.setLevel(logging.INFO)


@pytest.fixture(scope="session", autouse=True)
def _run_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the controller's folder, shared by the workers
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(base / "triton")


def worker_threads(workers: int) -> int:
    """The torch threads of one of `workers` pytest-xdist workers: its share of the cores
    this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // workers)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _long_modules_first(items)
    _skip_cuda_without_a_device(items)


def _long_modules_first(items: list[pytest.Item]) -> None:
    """Puts the modules with a `multirank` or `long` test before the others, each group in
    collection order and each module whole (its module-scoped fixtures are made once).

    Under -n, pytest-xdist's worksteal gives each worker a contiguous part of this list
    and an idle worker takes the end of a busy one's queue: with the long tests first,
    the run ends on the many short ones, which the workers share out evenly, instead
    of on one worker still running a 20-second test while the other has nothing left."""
    long_modules = {
        getattr(item, "module", None)
        for item in items
        if item.get_closest_marker("multirank") or item.get_closest_marker("long")
    }
    items.sort(key=lambda item: getattr(item, "module", None) not in long_modules)  # a stable sort


def _skip_cuda_without_a_device(items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)
