"""Saving sharded checkpoints: every rank writes its pieces, rank 0 commits.

    checkpointer = Checkpointer(save_dir, async_save=True, keep_last=3)
    checkpointer.save(iteration, pieces, common={...}, rank_state={...})
    ...
    checkpointer.finalize()     # at exit: waits for the save in flight, raises its error

`pieces` maps logical keys to ShardedTensors (the model's and the
optimizer's sharded_state_dict); only replica_id 0 pieces are written, each
by the rank that holds it, through torch.distributed.checkpoint (DCP) in
parallel. Rank 0 writes the plain state (`common`: iteration, scheduler,
config, ...) and the readable mp_metadata.json; every rank may add its own
`rank_state` (RNG states). See layout.py for the files and the commit.

Async save: the pieces are copied to host memory first (the only part the
training loop waits for), then a background thread writes them, checksums
them and commits. At most one save is in flight: the next save, or
finalize(), waits for the previous one and raises its error if it failed.
The background thread talks to the other ranks over a group of its own, so
its collectives never interleave with the training loop's.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mp_ckpt.core.failures import failure_line, has_errno
from mp_ckpt.core.integrity import CHECKSUMS, HashingFileSystemWriter, file_digest
from mp_ckpt.core.layout import checkpoint_dir, fsync_dir, remove_old_checkpoints, write_tracker
from mp_ckpt.core.sharding import ShardedTensor

__all__ = ["METADATA", "CheckpointSaveError", "Checkpointer", "single_process_quiet", "storage_key"]

METADATA = "mp_metadata.json"
_IO_THREADS = 2
FORMAT_VERSION = 1


class CheckpointSaveError(RuntimeError):
    """A save failed: names the iteration, the directory and the cause (a full
    file system says so, with the space left). The partial directory is removed; the
    checkpoints committed before, and the tracker, are as they were."""


def storage_key(piece: ShardedTensor) -> str:
    """The name a saved piece has in DCP's storage: unique per (key, box, range)."""
    where = ",".join(map(str, piece.global_offset))
    if piece.flattened_range is not None:
        where += f":{piece.flattened_range[0]}-{piece.flattened_range[1]}"
    return f"{piece.key}@{where}"


class Checkpointer:
    """Writes checkpoints under save_dir (collective: every rank calls save).

    Arguments:
        save_dir: the checkpoint root (Megatron's --save).
        async_save: write in a background thread after staging on the host.
        keep_last: keep only this many newest checkpoints (None: all).
        retain_interval: keep also those whose iteration is a multiple of it (with
            keep_last None: those and the newest).
        on_commit: called on rank 0 once a checkpoint is committed, with its iteration and
            the iterations keep_last deleted (from the writing thread when async).
    """

    def __init__(self, save_dir: str | os.PathLike, *, async_save: bool = False,
                 keep_last: int | None = None, retain_interval: int | None = None,
                 on_commit: Callable[[int, list[int]], None] | None = None) -> None:  # fmt: skip
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.save_dir = Path(save_dir)
        self.async_save = async_save
        self.keep_last = keep_last
        self.retain_interval = retain_interval
        self.on_commit = on_commit
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        # A gloo group of our own: a background save's collectives stay off the
        # groups the training loop uses.
        group = dist.new_group(backend="gloo") if self._distributed else None
        self._flight = _InFlight()
        self._group, self._staging = group, {}
        self.last_saved: int | None = None
        """The iteration of the latest save begun (committed, or in flight when async)."""

    def sibling(
        self,
        save_dir: str | os.PathLike,
        *,
        keep_last: int | None = None,
        retain_interval: int | None = None,
        on_commit: Callable[[int, list[int]], None] | None = None,
    ) -> Checkpointer:
        """A checkpointer saving under another root with its own keep_last (Megatron's
        non-persistent checkpoints, say), sharing this one's host staging buffers, gloo
        group and save in flight: a save by either waits for the other's to commit, so
        one host copy of the pieces serves both. Not collective (no group is created)."""
        other = copy.copy(self)
        other.save_dir = Path(save_dir)
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        other.keep_last, other.retain_interval = keep_last, retain_interval
        other.on_commit, other.last_saved = on_commit, None
        return other

    def save(
        self,
        iteration: int,
        pieces: Mapping[str, ShardedTensor],
        *,
        common: dict | None = None,
        rank_state: dict | None = None,
        layout: dict | None = None,
    ) -> None:
        """Saves checkpoint `iteration` (returns once it is committed, or once staged
        when async). `layout` (parallel sizes) is recorded for `mp-ckpt inspect`."""
        self.finalize()
        self.last_saved = iteration
        saved = _saved_pieces(pieces)
        if not self.async_save:
            self._write(iteration, saved, common, rank_state, layout)
            return
        staged = {k: self._stage(k, p) for k, p in saved.items()}
        # The plain state too is taken now: the loop may change it while the thread writes.
        common, rank_state = copy.deepcopy(common), copy.deepcopy(rank_state)
        self._flight.thread = threading.Thread(
            target=self._write_in_background, args=(iteration, staged, common, rank_state, layout),
            name=f"mp-ckpt-save-{iteration}", daemon=True,
        )  # fmt: skip
        self._flight.thread.start()

    def prepare(self, pieces: Mapping[str, ShardedTensor]) -> None:
        """Allocates and touches the host buffers an async save of these pieces stages
        into, so that no save pays for them (a run calls it once, at start). Does
        nothing for a synchronous Checkpointer."""
        if self.async_save:
            for name, piece in _saved_pieces(pieces).items():
                self._stage(name, piece)

    def finalize(self) -> None:
        """Waits for a save in flight; raises if it failed."""
        flight = self._flight
        if flight.thread is not None:
            flight.thread.join()
            flight.thread = None
        if flight.error is not None:
            error, flight.error = flight.error, None
            raise CheckpointSaveError(
                f"the asynchronous checkpoint save failed: {failure_line(error, self.rank)}"
            ) from error

    # --- the write and the commit ------------------------------------------------------

    def _stage(self, name: str, piece: ShardedTensor) -> ShardedTensor:
        """A host copy of the piece, taken now, for the background write. The host buffers
        are kept from one save to the next (the same pieces come back every time), so
        staging is a copy, not an allocation."""
        data = piece.data.detach()
        buffer = self._staging.get(name)
        if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
            pin = data.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(data.shape, dtype=data.dtype, pin_memory=pin)
            self._staging[name] = buffer
        buffer.copy_(data)
        return ShardedTensor(
            piece.key,
            buffer,
            piece.global_shape,
            piece.global_offset,
            piece.replica_id,
            piece.flattened_range,
            piece.local_shape,
        )

    def _write_in_background(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as error:  # surfaced by the next save or finalize
            self._flight.error = error

    def _write(self, iteration: int, saved: dict[str, ShardedTensor], common, rank_state,
               layout) -> None:  # fmt: skip
        tmp = checkpoint_dir(self.save_dir, iteration).with_name(f"iter_{iteration:07d}.tmp")
        try:
            self._write_and_commit(iteration, tmp, saved, common, rank_state, layout)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            mine = sum(p.data.numel() * p.data.element_size() for p in saved.values())
            message = _save_failure(self.rank, iteration, tmp, mine, error)
            # Nothing of this save may stay: a partial directory fills the disk further.
            # Rank 0 made it and removes it (the next save's rank 0 would, too).
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(message) from error

    def _write_and_commit(self, iteration: int, tmp: Path, saved: dict[str, ShardedTensor],
                          common, rank_state, layout) -> None:  # fmt: skip
        final = checkpoint_dir(self.save_dir, iteration)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        # Two files per rank, written by two threads, each hashing what it writes:
        # reading the files back to checksum them would cost a large part of a save.
        writer = HashingFileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                         thread_count=_IO_THREADS)  # fmt: skip
        with single_process_quiet():
            dcp.save({k: p.data for k, p in saved.items()}, storage_writer=writer,
                     process_group=self._group, no_dist=not self._distributed)  # fmt: skip
        mine = []
        if rank_state is not None:
            name = f"rank_{self.rank:05d}.pt"
            _save_synced(lambda f: torch.save(rank_state, f), tmp / name)
            mine.append(name)
        mine += [p.name for p in tmp.glob(f"__{self.rank}_*.distcp")]
        digests = {name: writer.digest(tmp / name) for name in mine}
        chunks = [_describe(k, p) for k, p in saved.items()]
        all_digests = self._gather(digests)
        all_chunks = self._gather(chunks)
        if self.rank == 0:
            _save_synced(lambda f: torch.save(common or {}, f), tmp / "common.pt")
            metadata = build_metadata(iteration, all_chunks, self.world_size, layout)
            _write_synced(tmp / METADATA, json.dumps(metadata, indent=1))
            files = {name: d for rank_digests in all_digests for name, d in rank_digests.items()}
            for name in ("common.pt", METADATA, ".metadata"):
                files[name] = file_digest(tmp / name)
            _write_synced(tmp / CHECKSUMS, json.dumps(files, indent=1, sort_keys=True))
            fsync_dir(tmp)
        self._barrier()
        if self.rank == 0:
            replace_dir(tmp, final)
            write_tracker(self.save_dir, iteration)
            deleted = remove_old_checkpoints(self.save_dir, self.keep_last,
                                             self.retain_interval)  # fmt: skip
            if self.on_commit is not None:
                self.on_commit(iteration, deleted)
        self._barrier()

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)

    def _gather(self, value) -> list:
        if not self._distributed:
            return [value]
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out


class _InFlight:
    """The background save in flight (one at a time), and its error until surfaced."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


def _save_failure(rank: int, iteration: int, tmp: Path, needed: int, error: BaseException) -> str:
    """What a failed save says: where, and why (rank's own failure, or the rank it came
    from); a full file system by name, with the space left."""
    cause = failure_line(error, rank)
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    full = has_errno(error, errno.ENOSPC) or (free is not None and free < needed)
    text = f"saving iteration {iteration} into {tmp} failed: {cause}"
    if full:
        text += (f"; the file system is full ({_mib(free)} free, and this rank's part of "
                 f"the checkpoint is {_mib(needed)}): make room for one more checkpoint "
                 "beside those kept, then resume from the last committed one")  # fmt: skip
    return text + "; the checkpoints committed before are untouched"


def _mib(size: int | None) -> str:
    return "unknown" if size is None else f"{size / 2**20:.1f} MiB"


def _saved_pieces(pieces: Mapping[str, ShardedTensor]) -> dict[str, ShardedTensor]:
    """The pieces this rank writes (replica 0), by storage key."""
    saved = {}
    for name, piece in pieces.items():
        if not isinstance(piece, ShardedTensor):
            raise TypeError(f"pieces[{name!r}] is a {type(piece).__name__}, not a ShardedTensor")
        if piece.replica_id == 0:
            saved[storage_key(piece)] = piece
    return saved


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that a process without torch.distributed saves or loads
    alone (the CLI and single-process runs do so on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def replace_dir(new: Path, final: Path) -> None:
    """Puts `new` at `final`. An existing `final` (a save of the same iteration again)
    is renamed aside first and deleted last: a crash between the steps leaves a
    complete directory under one of the two names, never none."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(new, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    _save_synced(lambda f: f.write(text.encode()), path)


def _save_synced(write, path: Path) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _describe(name: str, piece: ShardedTensor) -> dict:
    return {
        "key": piece.key,
        "storage_key": name,
        "dtype": str(piece.data.dtype).removeprefix("torch."),
        "global_shape": list(piece.global_shape),
        "offset": list(piece.global_offset),
        "shape": list(piece.shape),
        "flattened_range": list(piece.flattened_range) if piece.flattened_range else None,
    }


def build_metadata(iteration: int, per_rank_chunks: list[list[dict]], world_size: int,
              layout: dict | None) -> dict:  # fmt: skip
    tensors: dict[str, dict] = {}
    chunks = []
    for rank, rank_chunks in enumerate(per_rank_chunks):
        for chunk in rank_chunks:
            chunks.append({**chunk, "rank": rank})
            entry = tensors.setdefault(chunk["key"], {"shape": chunk["global_shape"],
                                                      "dtype": chunk["dtype"]})  # fmt: skip
            if entry["shape"] != chunk["global_shape"]:
                raise ValueError(
                    f"{chunk['key']}: ranks disagree on the global shape: "
                    f"{entry['shape']} and {chunk['global_shape']}"
                )
    return {
        "format": "mp-ckpt",
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "world_size": world_size,
        "layout": layout or {},
        "tensors": dict(sorted(tensors.items())),
        "chunks": chunks,
    }
