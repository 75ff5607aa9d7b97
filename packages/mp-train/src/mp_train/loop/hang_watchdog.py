"""Hang detection: a heartbeat per rank and a watchdog that names the rank that stopped.

    with HangWatchdog.for_run(timeout_s, rank, world_size) as watchdog:
        ...  # each finished iteration: watchdog.beat(iteration)

A rank that stops (SIGSTOP, a frozen node) or blocks (I/O, a deadlock) leaves the
others waiting in a collective until its timeout, with no word of which rank it was.
As the hang detection of NVIDIA's resiliency extension, every rank runs a small
thread that, every `period` seconds, publishes through torch.distributed's store
(the TCPStore torchrun starts) its heartbeat: the last finished iteration, a
progress count (iterations, evaluation steps) and a tick that advances as long as
the thread runs, with the place its main thread is at. The main thread only sets
an integer per iteration; the store traffic is the thread's.

Two ranks (the first and the last) judge (HangMonitor): once no rank has made
progress for `timeout_s`, the first of them to see it logs one line naming the
ranks whose thread stopped ticking (a stopped or frozen process: its own thread
cannot run), or else the ranks behind the others, or else every rank's place; it
asks every rank through the store to dump its Python stacks (faulthandler) to the
log, dumps its own, SIGKILLs a non-responding rank on its own host (SIGTERM never
reaches a stopped process) and leaves with exit code 1 (os._exit: the main thread
is stuck in a collective), so that torchrun ends the other ranks. The clock starts
at the first finished iteration (model build, checkpoint load and the first
iteration are left to the collective timeout); checkpoint saves pause it.

faulthandler is also registered on SIGUSR1 for the life of the watchdog:
`kill -USR1 <pid>` prints that rank's stacks at any time.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Beat", "Hang", "HangMonitor", "HangWatchdog"]

log = logging.getLogger("mp_train")

PREFIX = "mp_hang_watchdog/"

# Every rank creates its watchdogs in the same order (one per pretrain call): the count
# keeps a second run in the same process group clear of the first one's keys.
_created = 0


@dataclass
class Beat:
    """One rank's heartbeat as published in the store."""

    iteration: int
    """The last finished training iteration."""
    progress: int
    """Advances with every finished iteration and evaluation step."""
    tick: int
    """Advances every period while the rank's watchdog thread runs."""
    where: str = ""
    """file:line in function of the rank's main thread."""
    paused: bool = False
    """The rank is in a phase the clock does not judge (a checkpoint save)."""
    closed: bool = False
    """The rank has left the loop."""
    host: str = ""
    pid: int = 0

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def loads(text: str | bytes) -> Beat:
        return Beat(**json.loads(text))


@dataclass
class Hang:
    """The verdict: who is stuck, as one line."""

    stuck: list[int]
    unresponsive: list[int]
    """The stuck ranks whose watchdog thread stopped ticking (the process is stopped)."""
    message: str


class HangMonitor:
    """The judgement, without threads or a store: feed it every rank's beat (None
    where a rank has published none yet) with observe(); it answers a Hang once no
    rank progressed for timeout_s. Times are the judge's own clock (no clock is
    compared across hosts)."""

    def __init__(self, world_size: int, timeout_s: float, clock: Callable[[], float]) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._seen: dict[int, Beat] = {}
        self._progress_at: dict[int, float] = {}
        self._tick_at: dict[int, float] = {}
        self._started: float | None = None  # the first finished iteration seen

    def observe(self, beats: dict[int, Beat | None]) -> Hang | None:
        now = self.clock()
        for rank, beat in beats.items():
            if beat is None:
                continue
            old = self._seen.get(rank)
            if old is None or beat.progress != old.progress or beat.paused:
                self._progress_at[rank] = now
            if old is None or beat.tick != old.tick:
                self._tick_at[rank] = now
            moved = beat.progress > 0 if old is None else beat.progress != old.progress
            if moved and self._started is None:
                self._started = now
            self._seen[rank] = beat
        if self._started is None:
            return None
        live = [r for r in range(self.world_size) if not self._closed(r)]
        if not live or any(self._seen.get(r) is not None and self._seen[r].paused for r in live):
            return None
        latest = max(self._progress_at.get(r, self._started) for r in live)
        stalled = now - max(latest, self._started)
        if stalled < self.timeout_s:
            return None
        return self._verdict(live, now, stalled)

    def _closed(self, rank: int) -> bool:
        beat = self._seen.get(rank)
        return beat is not None and beat.closed

    def _verdict(self, live: list[int], now: float, stalled: float) -> Hang:
        # A thread misses a tick or two under load; three periods of silence (a
        # fifth of the timeout each) is a stopped process.
        silent_after = self.timeout_s * 0.6
        missing = [r for r in live if r not in self._seen]
        unresponsive = missing + [
            r for r in live if r in self._seen and now - self._tick_at[r] >= silent_after
        ]
        if unresponsive:
            stuck = sorted(unresponsive)
            what = (
                "stopped responding (its heartbeat thread is silent: a stopped or frozen process)"
            )
        else:
            lowest = min(self._seen[r].iteration for r in live)
            behind = [r for r in live if self._seen[r].iteration == lowest]
            stuck = behind if len(behind) < len(live) else live
            what = (
                "is behind the others"
                if len(behind) < len(live)
                else "all wait (no rank is silent or behind; see where each main thread is)"
            )
        parts = []
        for r in stuck:
            beat = self._seen.get(r)
            if beat is None:
                parts.append(f"rank {r} (no heartbeat yet)")
                continue
            silent = now - self._tick_at[r]
            parts.append(
                f"rank {r} (last finished iteration {beat.iteration}, heartbeat "
                f"{silent:.0f} s ago, at {beat.where or '?'})"
            )
        names = ", ".join(f"rank {r}" for r in stuck)
        message = (
            f"hang detected: no rank finished an iteration for {stalled:.0f} s "
            f"(hang_timeout_minutes={self.timeout_s / 60:g}); stuck: {names} {what}: "
            + "; ".join(parts)
        )
        return Hang(stuck=stuck, unresponsive=sorted(unresponsive), message=message)


class HangWatchdog:
    """This rank's heartbeat thread; on the judging ranks, also the watchdog."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *,
                 period_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], None] = os._exit, out=None) -> None:  # fmt: skip
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.period_s = period_s if period_s is not None else min(5.0, max(0.5, timeout_s / 5))
        judges = {0, world_size - 1}
        self.monitor = HangMonitor(world_size, timeout_s, clock) if rank in judges else None
        self.exit = exit
        self.out = out if out is not None else sys.stderr
        self._iteration = 0
        self._progress = 0
        self._tick = 0
        self._paused = 0
        self._host = socket.gethostname()
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._dumped = False
        self._present: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="mp-hang-watchdog", daemon=True)

    @classmethod
    def for_run(cls, timeout_minutes: float | None, rank: int, world_size: int):
        """The watchdog over torch.distributed's default store, or a null context when
        timeout_minutes is 0, or without a store (a one-rank run)."""
        import torch.distributed as dist

        if not timeout_minutes or not dist.is_initialized() or world_size < 2:
            return contextlib.nullcontext(_NullWatchdog())
        global _created
        _created += 1
        store = dist.PrefixStore(f"{PREFIX}{_created}/", dist.distributed_c10d._get_default_store())
        return cls(store, rank, world_size, timeout_minutes * 60)

    # -- the main thread's side: an assignment each, no store traffic.

    def beat(self, iteration: int) -> None:
        """A training iteration finished."""
        self._iteration = iteration
        self._progress += 1

    def step(self) -> None:
        """Progress that is not an iteration (an evaluation step)."""
        self._progress += 1

    @contextlib.contextmanager
    def paused(self):
        """A phase the clock does not judge (a checkpoint save: its length is the disk's)."""
        self._paused += 1
        try:
            yield
        finally:
            self._progress += 1
            self._paused -= 1

    def __enter__(self) -> HangWatchdog:
        faulthandler.register(signal.SIGUSR1, file=self.out, all_threads=True)
        self._publish(closed=False)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 5)
        with contextlib.suppress(Exception):
            self._publish(closed=True)
        faulthandler.unregister(signal.SIGUSR1)

    # -- the thread.

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception as error:  # a store gone at teardown: the job is ending anyway
                if not self._stop.is_set():
                    log.warning("rank %d: hang watchdog stopped: %s", self.rank, error)
                return

    def tick(self) -> Hang | None:
        """One period: publish, answer a dump request, judge. Returns the verdict found."""
        self._tick += 1
        self._publish(closed=False)
        if not self._dumped and self.store.check(["dump"]):
            request = json.loads(self.store.get("dump"))
            try:
                self._answer(request, f"requested by rank {request['by']}")
            finally:
                self.exit(1)
        if self.monitor is None:
            return None
        hang = self.monitor.observe(self._read_beats())
        mine = str(self.rank).encode()
        if hang is not None and self.store.compare_set("verdict", "", str(self.rank)) == mine:
            try:
                self._end_job(hang)
            finally:
                self.exit(1)
        return hang

    def _publish(self, closed: bool) -> None:
        beat = Beat(self._iteration, self._progress, self._tick, self._main_thread_place(),
                    paused=self._paused > 0, closed=closed, host=self._host,
                    pid=self._pid)  # fmt: skip
        self.store.set(f"beat/{self.rank}", beat.dumps())

    def _read_beats(self) -> dict[int, Beat | None]:
        keys = [f"beat/{r}" for r in range(self.world_size)]
        # A rank's key, once set, stays: only the missing ones are checked again.
        self._present.update(k for k in keys if k not in self._present and self.store.check([k]))
        present = [k for k in keys if k in self._present]
        values = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
        return {r: Beat.loads(values[k]) if k in values else None for r, k in enumerate(keys)}

    @staticmethod
    def _main_thread_place() -> str:
        if threading.current_thread() is threading.main_thread():
            return ""  # entering or leaving the loop
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return ""
        place = _place(frame)
        # Inside torch (a collective), its caller says more: which step waits.
        caller = frame
        while caller is not None and f"{os.sep}torch{os.sep}" in caller.f_code.co_filename:
            caller = caller.f_back
        if caller is not None and caller is not frame:
            place += f" called from {_place(caller)}"
        return place

    def _answer(self, request: dict, why: str) -> None:
        """Dump this rank's stacks; SIGKILL the silent ranks on this host: a stopped
        process takes no SIGTERM from torchrun (only SIGKILL acts on it), and torchrun
        would wait out its grace period for it."""
        self._dumped = True
        print(f"rank {self.rank}: Python stacks ({why}):", file=self.out, flush=True)
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()
        for rank, host, pid in request["kill"]:
            if host == self._host and pid and pid != os.getpid():
                log.error("SIGKILL to rank %d (pid %d, on this host): it is not responding",
                          rank, pid)  # fmt: skip
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.store.set(f"dumped/{self.rank}", "1")

    def _end_job(self, hang: Hang) -> None:
        """Log the verdict and have every live rank dump its stacks and leave (each
        with exit code 1: the job ends on every host, whatever launched it)."""
        log.error("%s", hang.message)
        seen = self.monitor._seen
        kill = [(r, seen[r].host, seen[r].pid) for r in hang.unresponsive if r in seen]
        request = {"by": self.rank, "kill": kill}
        self.store.set("dump", json.dumps(request))
        self._answer(request, "hang detected")
        live = [r for r in range(self.world_size) if r not in hang.unresponsive]
        deadline = time.monotonic() + 2 * self.period_s + 2
        while time.monotonic() < deadline:
            if all(self.store.check([f"dumped/{r}"]) for r in live):
                break
            time.sleep(0.1)


def _place(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class _NullWatchdog:
    def beat(self, iteration: int) -> None:
        pass

    def step(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self):
        yield
