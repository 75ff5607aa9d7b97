"""Runs a function on N ranks as real processes (gloo on the CPU, or NCCL), for tests.

Every multi-rank test of the project goes through `run_on_ranks`: it starts
one process per rank, joins them into one torch.distributed world (a FileStore
in a private temporary folder: no ports to race for), calls the function on
every rank and returns the per-rank return values. It never hangs:

- a rank that raises: its traceback is reported at once and the other ranks,
  which would otherwise wait forever in their next collective, are killed;
- a rank that dies (a signal, os._exit): its exit status is reported;
- ranks still running at the timeout: each dumps its Python stack
  (faulthandler on SIGUSR1) and then every rank is killed; the stacks are in
  the error, so a hang shows where each rank was waiting.

Device. `device` ("cpu" by default, or "cuda") is set as MP_DEVICE in every rank,
which mp_state.devices reads: a CPU rank computes on the CPU and talks over gloo
even on a machine with GPUs, and never initializes CUDA. A "cuda" rank uses GPU
LOCAL_RANK (mod the visible count) and NCCL, so several ranks need as many GPUs.

Start method. Measured on the 2-core CI machine with the PyPI torch build
(torch 2.15), run_on_ranks(dist.get_rank, 8) takes 12.8 s with spawn (each
child imports torch anew) and 0.17 s with fork. CPU ranks are therefore
forked (on Linux), even when the parent has used CUDA: like a DataLoader's
workers they never touch it, which is all a fork of a CUDA process forbids.
CUDA ranks are spawned: once the parent has asked torch about CUDA at all
(torch.cuda.is_available() does), a forked child cannot initialize it. A
forked child inherits the parent's OpenMP thread pool in a broken state: its
first multi-threaded op would wait for threads that do not exist, so each
child calls torch.set_num_threads(1) before anything else (ranks on one
machine share its cores anyway). For the same reason it drops inductor's compile
thread pool, if the parent made one (`_own_compile_pool`). Spawn can be forced with
`start_method="spawn"` or MP_TEST_START_METHOD=spawn. A spawned rank imports
the function by its module and name, so it must live in an importable module
(a test file under pytest's importlib mode is not one), and its arguments and
results must be picklable; a CUDA rank returns CPU values (a CUDA tensor would
initialize CUDA in the parent).

Before the first fork the parent does, once, what every rank would otherwise
do on its own at first use: torch.testing's comparison (imports sympy) and a
torch optimizer's first step (imports torch's compiler machinery, about 4 s
here). Four ranks importing at once on two cores took 8 s per test.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from mp_state.devices import DEVICE_ENV, select_device

__all__ = ["RankFailure", "RankTimeout", "default_start_method", "run_on_ranks"]

_GRACE_S = 1.0
"""After a first failure, how long other ranks get to report their own errors."""


class RankFailure(RuntimeError):
    """One or more ranks raised or died; `failures` maps rank -> report."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class RankTimeout(RankFailure):
    """Ranks were still running at the timeout; `failures` holds their stacks."""


def _start(process, method: str) -> None:
    """Starts a rank. A forked rank inherits the parent's objects, garbage included (a
    test's leftover DataLoader iterator, whose finalizer takes a semaphore shared with
    the parent's loader workers): frozen before the fork, they are never collected in the
    rank, so a rank killed mid-finalizer cannot leave the parent's collector waiting on
    that semaphore forever."""
    if method != "fork":
        process.start()
        return
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()


@functools.cache
def _warm_imports() -> None:
    """Imports, in the parent, what forked ranks would each import at first use."""
    torch.testing.assert_close(torch.ones(1), torch.ones(1))
    param = torch.nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    torch.optim.AdamW([param]).step()


def default_start_method(device: str = "cpu") -> str:
    """fork for CPU ranks on Linux, spawn for CUDA ranks and elsewhere;
    MP_TEST_START_METHOD first (see the module docstring)."""
    chosen = os.environ.get("MP_TEST_START_METHOD")
    if chosen:
        return chosen
    if sys.platform == "linux" and device == "cpu":
        return "fork"
    return "spawn"


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    device: str = "cpu",
    backend: str | None = None,
    start_method: str | None = None,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Calls fn(*args, **kwargs) on `world_size` ranks; returns their results by rank.

    Each rank sees torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...),
    MP_DEVICE=`device` ("cpu" or "cuda") and, unless `init_process_group` is False,
    an initialized default process group over `backend` (by default gloo on the CPU,
    nccl on CUDA). Raises RankFailure naming the failing rank with its traceback, or
    RankTimeout with the stack of every rank still running after `timeout` s.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected cpu or cuda")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    method = start_method or default_start_method(device)
    if method == "fork":
        _warm_imports()
    # The ranks, and the loader workers they start, share this process's multiprocessing
    # folder (made here at first use, removed when this process exits): a rank ends with
    # os._exit, which would leave a folder of its own behind.
    multiprocessing.util.get_temp_dir()
    ctx = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory(prefix="mp-ranks-") as tmp:
        ranks = []
        for rank in range(world_size):
            receiver, sender = ctx.Pipe(duplex=False)
            spec = _RankSpec(rank, world_size, tmp, device, backend, timeout, init_process_group)
            process = ctx.Process(
                target=_rank_main,
                args=(spec, sender, fn, args, kwargs),
                name=f"mp-rank-{rank}",
                daemon=True,
            )
            _start(process, method)
            sender.close()
            ranks.append(_Running(rank, process, receiver, spec.stack_path))
        try:
            return _collect(ranks, timeout)
        finally:
            for r in ranks:
                if r.process.is_alive():
                    r.process.kill()
                r.process.join()
                r.conn.close()


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    folder: str
    device: str
    backend: str
    timeout: float
    init_process_group: bool

    @property
    def stack_path(self) -> str:
        return os.path.join(self.folder, f"stack-{self.rank}.txt")


@dataclass
class _Running:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    stack_path: str


def _own_progress_bar_locks() -> None:
    """Gives this rank progress-bar locks of its own. tqdm (which torch.fx's interpreter
    and transformers use) guards its bars with a thread lock and a multiprocessing lock
    that a forked rank inherits from the parent: the first may have been held by another
    parent thread (tqdm's monitor) at the fork, the second is shared with every sibling
    and stays taken if one is killed holding it. Either way the rank's first bar would
    wait forever."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    lock_class = std.TqdmDefaultWriteLock
    lock_class.th_lock = std.TRLock()
    lock_class.mp_lock = multiprocessing.RLock()
    lock = lock_class()
    classes = [std.tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if cls is std.tqdm or "_lock" in vars(cls):
            cls._lock = lock


def _own_compile_pool() -> None:
    """Drops inductor's compile thread pool inherited from the parent. torch's own
    after-fork hook resets inductor's process pools but not AsyncCompile.pool(), a
    ThreadPoolExecutor that a parent which compiled with several compile threads holds:
    its threads are not in the child, so a rank's first compile, or its load of a kernel
    from the cache, waited forever on work nobody ran. The rank makes its own pool."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None:
        async_compile.AsyncCompile.pool.cache_clear()


def _rank_main(spec: _RankSpec, conn: Connection, fn: Callable, args: tuple, kwargs: dict):
    # First, before any torch op: a forked child cannot use the parent's thread pool.
    torch.set_num_threads(1)
    _own_progress_bar_locks()
    _own_compile_pool()
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.rank),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        **{DEVICE_ENV: spec.device},
    )
    try:
        if spec.device == "cuda":
            torch.cuda.set_device(select_device().device)
        if spec.init_process_group:
            store = dist.FileStore(os.path.join(spec.folder, "store"), spec.world_size)
            dist.init_process_group(
                spec.backend,
                store=store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout),
            )
        _send(conn, "ok", fn(*args, **kwargs))
        if dist.is_initialized():
            # No rank leaves while another may still talk to it.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        _send(conn, "error", traceback.format_exc())
    finally:
        conn.close()
        stack_file.flush()
        # Skip the parent's atexit handlers (pytest's among them) inherited by fork.
        os._exit(0)


def _send(conn: Connection, status: str, payload: Any) -> None:
    # Plain pickle, not Connection.send: that pickler hands tensors over as
    # shared-memory file descriptors served by this process, which may have
    # exited by the time the parent asks for them.
    conn.send_bytes(pickle.dumps((status, payload)))


def _collect(ranks: list[_Running], timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = {r.rank: r for r in ranks}
    first_failure_at = None
    while pending:
        now = time.monotonic()
        if first_failure_at is not None and now >= first_failure_at + _GRACE_S:
            break
        if now >= deadline:
            stacks = _dump_stacks(list(pending.values()))
            message = _timeout_message(len(ranks), timeout, stacks, sorted(results), failures)
            raise RankTimeout(message, stacks)
        wait_until = deadline if first_failure_at is None else first_failure_at + _GRACE_S
        by_handle = {}
        for r in pending.values():
            by_handle[r.conn] = r
            by_handle[r.process.sentinel] = r
        for handle in wait(list(by_handle), timeout=max(0.0, wait_until - now)):
            r = by_handle[handle]
            if r.rank not in pending:
                continue
            status, payload = _receive(r)
            del pending[r.rank]
            if status == "ok":
                results[r.rank] = payload
            else:
                failures[r.rank] = payload
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
    if failures:
        raise RankFailure(_failure_message(len(ranks), failures), failures)
    return [results[r] for r in range(len(ranks))]


def _receive(r: _Running) -> tuple[str, Any]:
    """The rank's report, or a description of how it died without one."""
    try:
        if r.conn.poll():
            return pickle.loads(r.conn.recv_bytes())
    except EOFError:
        pass  # it exited without sending: say how, below
    except Exception as exc:
        return "error", f"rank {r.rank}'s report could not be received: {exc!r}\n"
    r.process.join(timeout=5)
    code = r.process.exitcode
    if code is not None and code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return "error", f"rank {r.rank} {how} without reporting a result\n"


def _dump_stacks(running: list[_Running]) -> dict[int, str]:
    for r in running:
        if r.process.is_alive():
            os.kill(r.process.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 2.0
    stacks = {}
    for r in running:
        text = ""
        while time.monotonic() < deadline:
            text = _read(r.stack_path)
            if text.count("File ") and text.endswith("\n"):
                break
            time.sleep(0.05)
        stacks[r.rank] = _trim_stack(text) or "(no stack: the rank did not answer SIGUSR1)\n"
    return stacks


def _trim_stack(text: str) -> str:
    """Drops the frames below the launcher: a forked child also shows the parent's."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(("Current thread", "Thread ")):
            skipping = False
        if not skipping:
            kept.append(line)
        if "in _rank_main" in line:
            skipping = True
    return "".join(kept)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _failure_message(world_size: int, failures: dict[int, str]) -> str:
    parts = [f"rank {rank} of {world_size} failed:\n{report}" for rank, report in failures.items()]
    return "\n".join(parts)


def _timeout_message(
    world_size: int,
    timeout: float,
    stacks: dict[int, str],
    returned: list[int],
    failures: dict[int, str],
) -> str:
    hung = ", ".join(str(r) for r in stacks)
    waiting = f" (rank(s) {', '.join(map(str, returned))} returned)" if returned else ""
    parts = [
        f"rank(s) {hung} of {world_size} still running after {timeout:g} s{waiting}; their stacks:"
    ]
    parts += [f"--- rank {rank} ---\n{stack}" for rank, stack in stacks.items()]
    if failures:
        parts.append(_failure_message(world_size, failures))
    return "\n".join(parts)
