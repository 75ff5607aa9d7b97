"""Encoding blocks in N worker processes, results strictly in input order.

    with encoded_blocks(options, blocks, workers=4) as results:
        for block in results: ...   # EncodedBlock, in the order of `blocks`

workers=1 encodes in this process (no processes, no pickling). Otherwise a
ProcessPoolExecutor runs N workers, each building its Encoder (tokenizer,
Punkt) once in its initializer. At most 2 x N blocks are in flight, so memory
stays bounded however large the input, and the reader keeps every worker
busy while the main process writes the results of the oldest block.

Unlike multiprocessing.Pool, whose map hangs forever when a worker is killed
(say by the out-of-memory killer), the executor reports a dead worker as
BrokenProcessPool, which becomes a CliError here.

Workers are forked on Linux: they start at once, with every module already
imported (a spawned worker would spend seconds importing torch through
mp_data). Each worker ignores Ctrl-C, which the main process handles by
discarding its outputs and shutting the pool down, and asks the kernel to
kill it if the main process dies (even by SIGKILL), so no orphan keeps
tokenizing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mp_data.cli.encode import EncodedBlock, EncodeOptions, Encoder
from mp_data.cli.errors import CliError

__all__ = ["encoded_blocks"]

_IN_FLIGHT_PER_WORKER = 2


@contextlib.contextmanager
def encoded_blocks(
    options: EncodeOptions,
    blocks: Iterable[tuple[int, bytes]],
    workers: int,
    encoder: Encoder | None = None,
) -> Iterator[Iterator[EncodedBlock]]:
    """An iterator over the encoded `blocks`, in order; `encoder` serves workers=1."""
    if workers == 1:
        encoder = encoder or Encoder(options)
        yield (encoder.encode(data, first) for first, data in blocks)
        return
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=_context(),
        initializer=_start_worker,
        initargs=(options, os.getpid()),
    )
    try:
        yield _ordered(pool, blocks, workers * _IN_FLIGHT_PER_WORKER)
    finally:
        # After an error, do not wait for the queued blocks, only the running ones.
        pool.shutdown(wait=True, cancel_futures=True)


def _ordered(pool: ProcessPoolExecutor, blocks, in_flight: int) -> Iterator[EncodedBlock]:
    pending: deque[Future] = deque()
    try:
        for first, data in blocks:
            pending.append(pool.submit(_encode, data, first))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise CliError(
            "a worker process died unexpectedly (killed, or out of memory?); try fewer --workers"
        ) from None


def _context():
    if sys.platform == "linux":
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


# The worker process's Encoder: built once by _start_worker, used by every
# _encode call in that process (per-process state, as multiprocessing needs).
_encoder: Encoder | None = None


def _start_worker(options: EncodeOptions, parent: int) -> None:
    global _encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        _die_with_parent(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _encoder = Encoder(options)


def _encode(data: bytes, first_line: int) -> EncodedBlock:
    if _encoder is None:
        raise RuntimeError("_start_worker did not run in this worker process")
    return _encoder.encode(data, first_line)


def _die_with_parent(parent: int) -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not glibc-like: an orphan then exits when its queue breaks
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
