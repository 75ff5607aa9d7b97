"""The pretraining data loader: a dataset, a sampler for this data-parallel rank, a DataLoader.

build_pretraining_data_loader is Megatron-LM's function of the same name with
its global arguments made explicit: the caller (mp-train) passes the
micro-batch size and this rank's place in the data-parallel group, so mp-data
needs nothing of mp-state. dataloader_type picks the sampler:

    single    MegatronPretrainingSampler: one pass, in order, resumable
    cyclic    MegatronPretrainingRandomSampler: shuffled epochs, resumable
    external  none: the dataset is already an iterable of batches, returned as is

A worker that dies (killed, out of memory) is reported by the next batch drawn, or by
torch's SIGCHLD handler in the main thread wherever it is, both as
`DataLoader worker (pid N) is killed by signal: Killed.`: torch's own check at the next
batch names only the pid (or raises a reset connection to the dead worker), so the
loader's iterator says which worker ended and how. A worker that cannot send a batch
(multiprocessing's queue would print the error, drop the batch and leave the loader
waiting for it for ever) exits with status 74, reported as such.

Its iterator's `close()` stops the worker processes at once (a no-op without workers),
however far it was read: left to the garbage collector, an iterator held by an error's
traceback shuts its workers down whenever a collection happens to run, in whatever code
is running then, and waits there on locks it shares with them.
"""

from __future__ import annotations

import functools
import multiprocessing.connection
import multiprocessing.queues
import multiprocessing.util
import os
import signal
import sys
import traceback
from collections.abc import Sequence

import torch

from mp_data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

__all__ = ["DATALOADER_TYPES", "DataLoaderWorkerError", "build_pretraining_data_loader"]

DATALOADER_TYPES = ("single", "cyclic", "external")


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    *,
    dataloader_type: str,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    data_sharding: bool = True,
    drop_last: bool = True,
    pin_memory: bool = False,
    worker_ignored_signals: Sequence[int] = (),
):
    """A DataLoader yielding this rank's micro-batches after consumed_samples; None for no dataset.

    data_sharding applies to "cyclic" only, drop_last to "single" only (the
    cyclic sampler always drops a short last micro-batch). The loader's iterators have
    close(), which stops their worker processes (not for "external": the dataset itself).
    worker_ignored_signals: signals the worker processes ignore, for a caller that handles
    them and then stops the workers (mp-train's exit_signal: a scheduler that signals every process
    of a job would otherwise kill the workers under the training that is saving). Each
    worker sets them aside as it starts (worker_init_fn); one signalled while still
    starting ends as before.
    """
    # Checked before the None case, so a misspelt type fails on every rank
    # and split, not only where a dataset happens to exist.
    if dataloader_type not in DATALOADER_TYPES:
        raise ValueError(
            f"dataloader_type={dataloader_type!r} is not one of {', '.join(DATALOADER_TYPES)}"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must not be negative")
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            drop_last=drop_last,
        )
    else:
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset,
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            data_sharding=data_sharding,
        )
    return _PretrainingDataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Workers that outlive an epoch spare their start-up on every cyclic
        # epoch. They keep the dataset copy they started with, so a
        # RandomSeedDataset in them stays at the epoch the loader started in
        # (as in Megatron-LM).
        persistent_workers=num_workers > 0,
        worker_init_fn=functools.partial(_start_worker, tuple(worker_ignored_signals)),
    )


# The status of a worker that could not send a batch (sysexits' EX_IOERR).
_SEND_FAILED = 74


def _start_worker(ignored_signals: tuple[int, ...], worker_id: int) -> None:
    """Each worker's worker_init_fn: sets the ignored signals aside, and makes a batch the
    worker cannot send end the worker. multiprocessing's queue sends from a thread of its
    own, which prints the error and drops the batch (a socket that cannot be made for its
    memory, a file-descriptor limit reached, an object that cannot be pickled): torch's
    iterator, which takes the batches in order, would then wait for it for ever, seeing
    the worker alive. Ended, the worker is reported at the next batch drawn."""
    for sig in ignored_signals:
        signal.signal(sig, signal.SIG_IGN)
    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(_exit_on_send_error)


def _exit_on_send_error(error: Exception, obj) -> None:
    traceback.print_exception(error)
    print(f"DataLoader worker (pid {os.getpid()}) could not send a batch: {error!r}",
          file=sys.stderr, flush=True)  # fmt: skip
    os._exit(_SEND_FAILED)


class DataLoaderWorkerError(RuntimeError):
    """A DataLoader worker process ended while its loader was in use."""


class _PretrainingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose iterators say which worker died and how, and whose workers
    leave no temporary folder behind."""

    def __iter__(self):
        if self.num_workers > 0:
            # A worker hands each batch's memory over through a socket in a temporary
            # folder (multiprocessing's, made at first use), which it removes as it
            # exits, but not when it is killed. Made here first, the folder is the
            # caller's: the workers inherit it, and it goes when the caller exits.
            multiprocessing.util.get_temp_dir()
        return _WorkerWatch(super().__iter__(), self)


class _WorkerWatch:
    """A DataLoader iterator whose worker failures name the pid and the signal or status,
    and whose close() stops its workers."""

    def __init__(self, iterator, loader: torch.utils.data.DataLoader) -> None:
        self._iterator, self._loader = iterator, loader

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._iterator)

    def close(self) -> None:
        """Stops the worker processes now and lets the torch iterator go; later next()
        calls raise StopIteration (as a closed generator's). The loader's next iterator
        starts workers of its own."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        workers = list(getattr(iterator, "_workers", ()))  # workers > 0 only
        if any(_how_it_ended(w) is not None for w in workers):
            _stop_after_a_death(iterator, workers)
        elif workers:
            iterator._shutdown_workers()
        if getattr(self._loader, "_iterator", None) is iterator:  # persistent workers
            self._loader._iterator = None

    def __next__(self):
        if self._iterator is None:
            raise StopIteration
        try:
            return next(self._iterator)
        except (StopIteration, DataLoaderWorkerError):
            raise
        except Exception as error:
            workers = list(getattr(self._iterator, "_workers", ()))
            if workers and isinstance(error, (OSError, EOFError)):
                # A batch cut off by its worker's death (a reset connection to the dying
                # worker) can arrive a moment before the worker can be waited for: give
                # the workers a second to be seen ended (join waits once the pipe closes).
                sentinels = [w.sentinel for w in workers]
                ready = multiprocessing.connection.wait(sentinels, timeout=1.0)
                for worker in workers:
                    if worker.sentinel in ready:
                        worker.join(timeout=1.0)
            ended = [e for e in map(_how_it_ended, workers) if e is not None]
            if not ended:
                raise
            raise DataLoaderWorkerError("; ".join(ended)) from error


def _stop_after_a_death(iterator, workers: list) -> None:
    """Stops the workers of a torch iterator one of which has died, without its
    _shutdown_workers: that sets a multiprocessing event whose lock the workers take at
    every check, and a worker killed while holding it leaves the lock taken for good (the
    shutdown then waits forever). The others are killed and reaped instead, the queues
    closed without waiting for their feeder threads, and the iterator marked shut down so
    that its own shutdown (at garbage collection) does nothing. The workers leave torch's
    SIGCHLD bookkeeping first: its handler would raise again, inside this close(), at
    each worker killed here while the dead one is still listed."""
    iterator._shutdown = True
    if getattr(iterator, "_worker_pids_set", False):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    if hasattr(iterator, "_pin_memory_thread"):  # a thread: its event is no process's
        iterator._pin_memory_thread_done_event.set()
        iterator._pin_memory_thread.join(timeout=10.0)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join(timeout=10.0)
    for queue in [*getattr(iterator, "_index_queues", ()), iterator._worker_result_queue]:
        queue.cancel_join_thread()
        queue.close()


def _how_it_ended(worker) -> str | None:
    """torch's SIGCHLD handler's words for a worker that has ended; None while it runs."""
    if worker.is_alive() or worker.exitcode is None:  # is_alive() reaps an ended worker
        return None
    code, said = worker.exitcode, f"DataLoader worker (pid {worker.pid})"
    if code < 0:
        return f"{said} is killed by signal: {signal.strsignal(-code)}."
    if code == _SEND_FAILED:
        return (f"{said} exited unexpectedly with exit code {code}: it could not send a "
                "batch (its error is on standard error).")  # fmt: skip
    if code > 0:
        return f"{said} exited unexpectedly with exit code {code}."
    return None
