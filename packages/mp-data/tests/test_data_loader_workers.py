"""A pretraining loader whose worker dies says which worker and how it ended, by either of
torch's two checks: its SIGCHLD handler, or the check at the next batch drawn."""

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

from mp_data import DataLoaderWorkerError, build_pretraining_data_loader

# A loader that waits for a batch no worker sends waits for good (torch's iterator sees
# its workers alive): each test here takes seconds, so one that hangs fails in 2 minutes,
# with its stack, rather than at the suite's 15.
pytestmark = pytest.mark.timeout(120)

SAID = r"DataLoader worker \(pid {pid}\) is killed by signal: Killed\."


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def loader():
    return build_pretraining_data_loader(
        Numbers(), 0, dataloader_type="single", micro_batch_size=2, data_parallel_rank=0,
        data_parallel_size=1, num_workers=2,
    )  # fmt: skip


class Unsendable(str):
    """A sample the default collate passes through as is, and that cannot be pickled."""

    def __reduce__(self):
        raise OSError("this sample cannot leave its worker")


class Texts(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> str:
        return Unsendable(index)


def test_a_batch_its_worker_cannot_send_ends_the_worker_and_is_named(capfd):
    batches = iter(build_pretraining_data_loader(
        Texts(), 0, dataloader_type="single", micro_batch_size=2, data_parallel_rank=0,
        data_parallel_size=1, num_workers=2,
    ))  # fmt: skip
    try:
        with pytest.raises(DataLoaderWorkerError) as raised:
            next(batches)
    finally:
        batches.close()
    said = r"DataLoader worker \(pid \d+\) exited unexpectedly with exit code 74: it could "
    assert re.match(
        said + r"not send a batch \(its error is on standard error\)\.", str(raised.value)
    )
    assert "OSError: this sample cannot leave its worker" in capfd.readouterr().err


def test_workers_ignore_the_signal_their_caller_handles():
    """worker_ignored_signals: a SIGTERM sent to every process (a scheduler's) leaves the
    workers to the caller, which stops them itself."""
    batches = iter(build_pretraining_data_loader(
        Numbers(), 0, dataloader_type="single", micro_batch_size=2, data_parallel_rank=0,
        data_parallel_size=1, num_workers=2, worker_ignored_signals=[signal.SIGTERM],
    ))  # fmt: skip
    try:
        # Batches come from the workers in turn: the second is worker 1's, so both have
        # started (set the signal aside) before it is sent.
        first, _ = next(batches), next(batches)
        workers = batches._iterator._workers
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
        # Both workers go on making batches (each has to, for 200 of them in order).
        drawn = [next(batches) for _ in range(200)]
        assert all(worker.is_alive() for worker in workers)
        assert torch.equal(drawn[-1], first + 2 * 201)
    finally:
        batches.close()
    assert not any(worker.is_alive() for worker in workers)


KILL_A_WORKER_RUN = """
import faulthandler, os, signal, sys
faulthandler.dump_traceback_later(50, exit=True)  # the stacks, should it ever hang
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from test_data_loader_workers import loader
batches = iter(loader())
if sys.argv[2] == "next batch":
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler, which iter() installed
next(batches), next(batches)  # each worker has sent a batch: a socket for its memory
workers = batches._iterator._workers
pid = workers[0].pid
try:
    os.kill(pid, signal.SIGKILL)
    for _ in range(10_000):
        next(batches)
except RuntimeError as error:
    print(pid, type(error).__name__, type(error.__cause__).__name__, error, flush=True)
batches.close()
print(sum(w.is_alive() for w in workers), "alive", flush=True)
print(next(batches, "stopped"), flush=True)
"""


@pytest.mark.parametrize("check", ["next batch", "SIGCHLD handler"])
def test_a_killed_worker_is_named_with_its_signal(tmp_path, check):
    # torch's SIGCHLD handler raises wherever the main thread is when SIGCHLD arrives;
    # without it, torch's check at the next batch finds the worker gone (within its 5 s
    # poll) and names only the pid, or the batch the worker was sending fails with a reset
    # connection. Either way the error names the worker and the signal. Then close() stops
    # the other worker (without the handler raising into it), and the iterator is done.
    # In a process of its own: the handler raises there, not in the test run, and the
    # loader's workers are forked from a process with nothing of other tests in it.
    # A worker shares each batch's memory through a socket in a temporary folder, which
    # one killed cannot remove: the workers use their caller's folder (under TMPDIR here),
    # which goes when the caller exits.
    env = os.environ | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", KILL_A_WORKER_RUN, __file__, check],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    raised, alive, after = done.stdout.splitlines()
    pid, kind, cause, said = raised.split(" ", 3)
    assert re.fullmatch(SAID.format(pid=pid), said.strip()), said  # (torch ends it in a space)
    if check == "next batch":  # (the handler may raise outside the loader's iterator)
        assert kind == "DataLoaderWorkerError" and cause != "DataLoaderWorkerError"
    assert (alive, after) == ("0 alive", "stopped")
    # multiprocessing's folder (pymp-...) is gone. (Once, of many runs under load, a file
    # or folder named as tempfile names them by default, tmp........, was left here too:
    # not the workers', whose folder is the one above.)
    assert list(tmp_path.glob("pymp-*")) == [], sorted(tmp_path.rglob("*"))


def _hold_and_die(event) -> None:
    # What a worker checking the event does; then it is killed. The killed worker may have
    # died holding the lock itself (it takes it at every check): then this waits in vain,
    # gives up and dies too, and the lock is a dead process's all the same.
    event._cond.acquire(True, 10.0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_close_returns_when_a_killed_process_held_the_workers_lock():
    # torch's own shutdown sets the event the workers check under a shared lock; a worker
    # killed while holding that lock would leave the shutdown waiting forever. Here one
    # worker is killed and a process that took the lock dies holding it: close() returns.
    # close() runs whatever happens before it: the iterator left to the garbage collector
    # would run torch's shutdown during some later test and wait there for good.
    torch_handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    batches = iter(loader())
    closing = threading.Thread(target=batches.close, daemon=True)
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        next(batches)
        iterator = batches._iterator
        workers = iterator._workers
        os.kill(workers[0].pid, signal.SIGKILL)
        workers[0].join(timeout=30)
        holder = multiprocessing.get_context("fork").Process(
            target=_hold_and_die, args=(iterator._workers_done_event,)
        )
        holder.start()
        holder.join(timeout=30)
        assert holder.exitcode == -signal.SIGKILL
    finally:
        closing.start()
        closing.join(timeout=60)
        signal.signal(signal.SIGCHLD, torch_handler)
    assert not closing.is_alive(), "close() waits on the dead process's lock"
    assert not any(w.is_alive() for w in workers)
