"""Loading a sharded checkpoint into this rank's pieces, under any layout.

    loaded = load_checkpoint(load_dir, pieces)     # fills every piece's data in place

`pieces` describes what this rank holds now (the model's and optimizer's
sharded_state_dict under the current layout). For each piece only the saved
chunks of the same logical tensor that overlap it are read: the shared box
straight into its place in the piece (box_reads.py), or, for flattened
ranges, the chunk whole and then its shared elements (regions.py). So a
checkpoint saved at
TP2 x PP2 x DP2 loads at TP1, TP4, another pipeline split or another
data-parallel size alike. Collective: every rank calls it.

The files are checked against checksums.json, the ranks sharing the work:
the small ones before anything is read, the data files (*.distcp) in a
thread while DCP reads them (hashing and reading overlap); a missing or
corrupted file is an error naming it, on every rank, raised before
load_checkpoint returns (also when the read itself failed on it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from mp_ckpt.core.box_reads import read_boxes, stored_buffer
from mp_ckpt.core.checkpointer import METADATA
from mp_ckpt.core.integrity import CheckpointCorrupted, recorded_files, verify_files
from mp_ckpt.core.layout import checkpoint_dir, read_tracker
from mp_ckpt.core.regions import Region, copy_shared, local_box
from mp_ckpt.core.sharding import ShardedTensor

log = logging.getLogger(__name__)

__all__ = ["LoadedCheckpoint", "load_checkpoint", "read_metadata"]


@dataclass
class LoadedCheckpoint:
    iteration: int
    directory: Path
    common: dict
    """Rank 0's plain state as saved (scheduler, config, consumed samples, ...)."""

    rank_state: dict | None
    """This rank's own saved state, when the world size is the one saved; else None."""

    missing: list[str] = field(default_factory=list)
    """Keys asked for that the checkpoint lacks (non-strict loads leave them as they were)."""

    unexpected: list[str] = field(default_factory=list)
    """Saved keys no rank asked for."""


def read_metadata(directory: str | os.PathLike) -> dict:
    """mp_metadata.json of a checkpoint directory."""
    path = Path(directory) / METADATA
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: not an mp-ckpt checkpoint directory")
    return json.loads(path.read_text())


def resolve(load_dir: str | os.PathLike, iteration: int | None = None) -> tuple[int, Path]:
    """The iteration to load (the tracker's unless given) and its directory."""
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            raise FileNotFoundError(f"no checkpoint under {load_dir}: no tracker file")
    directory = checkpoint_dir(load_dir, iteration)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} does not exist")
    return iteration, directory


def load_checkpoint(
    load_dir: str | os.PathLike,
    pieces: Mapping[str, ShardedTensor],
    *,
    iteration: int | None = None,
    strict: bool = True,
    verify: bool = True,
    finetune: bool = False,
    every_key_saved: bool = False,
    mismatch: tuple[str, str] | None = None,
    unasked_optimizer: bool = False,
) -> LoadedCheckpoint:
    """Fills `pieces` from a checkpoint under load_dir (see the module docstring).

    strict: every asked key must be saved and every saved key asked for.
    mismatch: instead of strict, what an asked key that is not saved and a saved key
    nobody asked for each do: "raise", "log" (a warning naming them; a missing piece keeps
    its values) or "ignore" (strict: ("raise", "raise"); not strict: ("ignore", "ignore")).
    unasked_optimizer: saved optimizer states ("optimizer." keys) are not expected (a load
    without the optimizer).
    every_key_saved: every asked key must be saved, whatever `strict` says (for pieces
    that hold no values before the load: a model built without drawing its weights).
    finetune: model only: saved optimizer states ("optimizer." keys) are not
    expected, and the result reads iteration 0 without rank state (a new run
    starting from these weights).
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    iteration, directory = resolve(load_dir, iteration)
    check = _Verification(directory, rank, world, distributed) if verify else None
    meta = read_metadata(directory)
    chunks_by_key: dict[str, list[dict]] = {}
    for chunk in meta["chunks"]:
        chunks_by_key.setdefault(chunk["key"], []).append(chunk)

    asked = {piece.key for piece in pieces.values()}
    everyone_asked = set().union(*_gather(sorted(asked), distributed, world))
    missing = sorted(asked - set(meta["tensors"]))
    unexpected = sorted(set(meta["tensors"]) - everyone_asked)
    if finetune or unasked_optimizer:
        unexpected = [k for k in unexpected if not k.startswith("optimizer.")]
    mismatched = [
        f"{p.key}: saved {tuple(meta['tensors'][p.key]['shape'])}, now {tuple(p.global_shape)}"
        for p in pieces.values()
        if p.key in meta["tensors"] and tuple(meta["tensors"][p.key]["shape"]) != p.global_shape
    ]
    all_missing = sorted(set().union(*_gather(missing, distributed, world)))
    all_mismatched = sorted(set().union(*_gather(mismatched, distributed, world)))
    if all_mismatched:
        raise ValueError(
            f"{directory}: {len(all_mismatched)} tensors cannot be resharded (their global "
            "shapes differ):\n  " + "\n  ".join(all_mismatched)
        )
    on_missing, on_unexpected = mismatch or (("raise",) * 2 if strict else ("ignore",) * 2)
    raising = (on_missing == "raise" and all_missing) or (on_unexpected == "raise" and unexpected)
    if raising or (every_key_saved and all_missing):
        raise KeyError(
            f"{directory}: missing keys {all_missing[:20]}{' ...' if len(all_missing) > 20 else ''}"
            f"; unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
        )
    if rank == 0:
        for kind, keys, policy in (("missing", all_missing, on_missing),
                                   ("unexpected", unexpected, on_unexpected)):  # fmt: skip
            if keys and policy == "log":
                log.warning("%s: %d %s keys (loaded without them): %s%s", directory, len(keys),
                            kind, keys[:20], " ..." if len(keys) > 20 else "")  # fmt: skip

    # Where a saved box overlaps a wanted box, DCP reads the overlap straight into its
    # place in the piece. Flattened ranges (the distributed optimizer's) are read whole
    # into a buffer per saved chunk, then copied element by element.
    reads: dict[str, list] = {}
    buffers: dict[str, torch.Tensor] = {}
    coverage = []  # (piece, its region, elements read in place, [(buffer, its region)])
    with torch.no_grad():
        for piece in pieces.values():
            target = Region(piece.global_offset, piece.shape, piece.flattened_range)
            in_place, via_buffer = 0, []
            for chunk in chunks_by_key.get(piece.key, ()):
                source = Region.from_chunk(chunk)
                shared = source.box_overlap(target)
                if shared is None:
                    continue
                name = chunk["storage_key"]
                if source.flattened_range is None and target.flattened_range is None:
                    destination = piece.data[local_box(shared, target)]
                    reads.setdefault(name, []).append((local_box(shared, source), destination))
                    in_place += destination.numel()
                    continue
                if name not in buffers:
                    buffers[name], whole = stored_buffer(chunk)
                    reads.setdefault(name, []).append((whole, buffers[name]))
                via_buffer.append((name, source))
            coverage.append((piece, target, in_place, via_buffer))
        try:
            if reads or distributed:
                read_boxes(directory, reads, distributed=distributed)
        except (Exception, CheckpointException):  # DCP's is not an Exception
            if check is not None:
                check.finish()  # a corrupted or missing file explains the failure: name it
            raise
        if check is not None:
            check.finish()
        for piece, target, in_place, via_buffer in coverage:
            copied = in_place + sum(
                copy_shared(buffers[name], source, piece.data, target)
                for name, source in via_buffer
            )
            if (in_place or via_buffer) and copied != piece.numel:
                raise CheckpointCorrupted(
                    f"{directory}: {piece.key} at {piece.global_offset}: the saved pieces "
                    f"cover {copied} of its {piece.numel} elements"
                )
    del buffers

    common = torch.load(directory / "common.pt", weights_only=False)
    rank_file = directory / f"rank_{rank:05d}.pt"
    rank_state = None
    if meta["world_size"] == world and rank_file.exists():
        rank_state = torch.load(rank_file, weights_only=False)
    if finetune:
        iteration, rank_state = 0, None
    return LoadedCheckpoint(iteration, directory, common, rank_state, missing, unexpected)


def _gather(value, distributed: bool, world: int) -> list:
    if not distributed:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


class _Verification:
    """This rank's share of the integrity check (collective: every rank makes one and
    calls finish). The small files are checked at once, before anything is read; the
    data files (*.distcp) by a thread, while DCP reads them."""

    def __init__(self, directory: Path, rank: int, world: int, distributed: bool) -> None:
        self.directory, self.world, self.distributed = directory, world, distributed
        recorded = recorded_files(directory)
        names = sorted(recorded)
        small = [n for n in names if not n.endswith(".distcp")][rank::world]
        data = [n for n in names if n.endswith(".distcp")][rank::world]
        self._raise_if_any(verify_files(directory, small, recorded))
        self._problems: list[str] = []

        def check_data_files() -> None:
            try:
                self._problems = verify_files(directory, data, recorded)
            except Exception as error:  # reported like a bad file: every rank must hear it
                self._problems = [f"{directory}: the check failed on rank {rank}: {error!r}"]

        self._thread = threading.Thread(target=check_data_files, daemon=True,
                                        name="mp-ckpt-verify")  # fmt: skip
        self._thread.start()

    def finish(self) -> None:
        """Waits for the data files' check; raises CheckpointCorrupted on every rank if
        any rank found a problem."""
        self._thread.join()
        self._raise_if_any(self._problems)

    def _raise_if_any(self, problems: list[str]) -> None:
        gathered = _gather(problems, self.distributed, self.world)
        every = [p for rank_problems in gathered for p in rank_problems]
        if every:
            # The first problem on the first line: a one-line report shows it.
            more = (
                f" (and {len(every) - 1} more:)\n  " + "\n  ".join(every[1:]) if every[1:] else ""
            )
            raise CheckpointCorrupted(
                f"{self.directory} failed its integrity check: {every[0]}{more}"
            )
