"""The server's bounded queue of requests and the loop that batches them.

A request waits in a FIFO queue of at most `max_queue` requests (a request beyond
that is refused at once: `QueueFull`). While one batch generates, the requests that
arrive wait; when it ends, the loop takes the oldest waiting requests together, as
many as fit in `max_batch_size` prompts (always at least one), and runs them as the
next batch. `run` is blocking (the model's collectives): it runs on one worker thread,
so the event loop keeps answering (and refusing) requests meanwhile. After `close`,
waiting requests and new ones fail with `ShuttingDown`; the running batch finishes.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

__all__ = ["Batcher", "QueueFull", "ShuttingDown"]


class QueueFull(RuntimeError):
    """The queue holds max_queue requests already (HTTP 503)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no more work (HTTP 503)."""


@dataclass
class _Waiting:
    request: Any
    size: int  # its prompts
    future: asyncio.Future


class Batcher:
    """run(requests) -> one result per request, blocking; idle() is called on the
    worker thread after `idle_seconds` without work (the followers' heartbeat)."""

    def __init__(self, run: Callable[[list], Sequence], executor: Executor, *,
                 max_batch_size: int, max_queue: int, idle: Callable[[], None],
                 idle_seconds: float = 60.0) -> None:  # fmt: skip
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.run, self.executor, self.idle = run, executor, idle
        self.max_batch_size, self.max_queue, self.idle_seconds = (
            max_batch_size, max_queue, idle_seconds)  # fmt: skip
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._wake = asyncio.Event()
        self._closed = False

    async def submit(self, request: Any, size: int) -> Any:
        """The request's result once its batch has run; size: its prompts."""
        if self._closed:
            raise ShuttingDown("the server is shutting down")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); "
                            "try again later")  # fmt: skip
        waiting = _Waiting(request, size, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._wake.set()
        return await waiting.future

    def close(self) -> None:
        """Takes no more requests and fails the waiting ones; `serve` returns after the
        running batch."""
        self._closed = True
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.future.done():
                waiting.future.set_exception(ShuttingDown("the server is shutting down"))
        self._wake.set()

    async def serve(self) -> None:
        """Runs batches until `close`."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._waiting:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.idle_seconds)
                except TimeoutError:
                    await loop.run_in_executor(self.executor, self.idle)
                continue
            batch = self._take()
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self.executor, self.run,
                                                     [w.request for w in batch])  # fmt: skip
            except Exception as error:  # the batch's requests fail; the server goes on
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(error)
                continue
            for waiting, result in zip(batch, results, strict=True):
                if not waiting.future.done():
                    waiting.future.set_result(result)

    def _take(self) -> list[_Waiting]:
        """The oldest waiting requests that fit in max_batch_size prompts together
        (the first always), those whose clients went away left out."""
        batch, prompts = [], 0
        while self._waiting:
            waiting = self._waiting[0]
            if waiting.future.done():
                self._waiting.popleft()
                continue
            if batch and prompts + waiting.size > self.max_batch_size:
                break
            batch.append(self._waiting.popleft())
            prompts += waiting.size
        return batch
