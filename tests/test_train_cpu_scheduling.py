"""A CPU training run puts its threads under SCHED_BATCH, the rank groups' gloo threads
included, and says so in one line; --no-cpu-batch-scheduling keeps the default policy.
mp_train/loop/cpu_scheduling.py; packages/mp-train/tests/test_cpu_scheduling.py tests the
function itself.

Each rank first puts its threads back under SCHED_OTHER: the test processes run under
SCHED_BATCH already (conftest.py)."""

import os

import pytest

from mp_gpt.testing import tiny_options, train_on_rank, train_output_on_rank
from mp_state.testing import run_on_ranks

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


def _default_policy_everywhere() -> None:
    for tid in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def train_from_the_default_policy(argv: list[str]):
    _default_policy_everywhere()
    status, printed = train_output_on_rank(argv)
    return status, printed, _policies()


@pytest.mark.parametrize("flag", [None, "--no-cpu-batch-scheduling"])
def test_a_cpu_run_schedules_its_threads_in_batch_and_says_so(tmp_path, flag):
    argv = tiny_options(tmp_path, "--train-iters", "2", *([flag] if flag else []))
    for status, printed, policies in run_on_ranks(train_from_the_default_policy, 2, argv):
        assert status == 0
        line = next(x for x in printed.splitlines() if "CPU scheduling:" in x)
        if flag:
            assert line.endswith("CPU scheduling: left as it is (--no-cpu-batch-scheduling)")
            assert policies == {os.SCHED_OTHER}
        else:
            assert "CPU scheduling: SCHED_BATCH for the process's" in line, line
            assert policies == {os.SCHED_BATCH}  # the rank groups' gloo threads too


def generator_from_the_default_policy(checkpoint: str, extra: list[str]):
    from mp_gpt.generate import Generator

    _default_policy_everywhere()
    generator = Generator(checkpoint, ["--tensor-model-parallel-size", "2", *extra])
    try:
        return generator.scheduling, _policies()
    finally:
        generator.close()


def test_a_cpu_generator_schedules_its_threads_in_batch(tmp_path):
    """mp_gpt.generate's Generator (the generate command and the server) on the CPU at TP2:
    each new token makes small collectives in every layer, as a training step does."""
    ckpt = tmp_path / "ckpt"
    argv = tiny_options(tmp_path, "--train-iters", "2", "--save", str(ckpt),
                        "--save-interval", "2")  # fmt: skip
    run_on_ranks(train_on_rank, 1, argv)
    for said, policies in run_on_ranks(generator_from_the_default_policy, 2, str(ckpt), []):
        assert said.startswith("SCHED_BATCH for the process's"), said
        assert policies == {os.SCHED_BATCH}
    flag = ["--no-cpu-batch-scheduling"]
    for said, policies in run_on_ranks(generator_from_the_default_policy, 2, str(ckpt), flag):
        assert said is None and policies == {os.SCHED_OTHER}
