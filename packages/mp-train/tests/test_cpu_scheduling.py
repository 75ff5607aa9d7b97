"""batch_scheduling: every thread of the process under SCHED_BATCH, gloo's included, and
the threads started after it too; a policy set before the run is kept.

Each case runs in a rank forked by the test launcher (the policy is per thread and
inherited), which first puts its threads back under SCHED_OTHER: the test processes run
under SCHED_BATCH already (conftest.py)."""

import os
import threading

import pytest

from mp_state.testing import run_on_ranks
from mp_train.loop.cpu_scheduling import batch_scheduling

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's"),
    pytest.mark.skipif(
        os.environ.get("MP_TEST_BATCH_SCHEDULING") == "refused",
        reason="this system refuses SCHED_BATCH (conftest.py)",
    ),
]


def _policies() -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}


def _with_a_thread(fn):
    """fn() while a second thread of this process (started before it) waits; what fn
    returned, the policies of all the threads, and the policy of a thread started after."""
    release = threading.Event()
    waiting = threading.Thread(target=release.wait)
    waiting.start()
    try:
        done = fn()
        policies = _policies()
    finally:
        release.set()
        waiting.join()
    later = []
    thread = threading.Thread(target=lambda: later.append(os.sched_getscheduler(0)))
    thread.start()
    thread.join()
    return done, policies, later[0]


def _default_policy_everywhere() -> None:
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def batch_from_the_default_policy():
    _default_policy_everywhere()  # gloo's threads among them: the group is up
    threads = len(os.listdir("/proc/self/task"))
    return threads, _with_a_thread(batch_scheduling)


def test_every_thread_and_the_next_ones_run_under_sched_batch():
    threads, (said, policies, later) = run_on_ranks(batch_from_the_default_policy, 1)[0]
    assert threads > 2, threads  # the main thread, gloo's loop and worker threads
    assert policies == {os.SCHED_BATCH}
    assert later == os.SCHED_BATCH
    # the threads counted while the waiting thread ran: one more than before it
    assert said.startswith(f"SCHED_BATCH for the process's {threads + 1} threads"), said


def idle_before():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return _with_a_thread(batch_scheduling)


def test_a_policy_set_before_the_run_is_kept():
    said, policies, later = run_on_ranks(idle_before, 1, init_process_group=False)[0]
    assert said == "left as it is (SCHED_IDLE, set before the run)"
    assert policies == {os.SCHED_IDLE} and later == os.SCHED_IDLE
