"""A Hugging Face directory written from the pieces the ranks of a run hold, without a
checkpoint on disk first.

    export_hf_from_pieces(pieces, common, out_dir, device=...)

Collective: every rank calls it with its pieces (the model's sharded_state_dict, the
data-parallel copies marked as replicas). The export (exporter.write_hf) runs on every
rank in the same order; each logical tensor it reads is gathered to rank 0 (every rank
writes its saved pieces, replica_id 0, into a zero tensor of the global shape and a sum
reduces them there: the saved pieces tile it once), one tensor at a time. Rank 0 writes
the directory under a temporary name beside out_dir and renames it into place when it is
complete, replacing an earlier export there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from mp_ckpt.core.regions import Region
from mp_ckpt.core.sharding import ShardedTensor
from mp_ckpt.hf.exporter import write_hf

__all__ = ["GatheredPieces", "check_export_target", "export_hf_from_pieces"]


class GatheredPieces:
    """The logical tensors of every rank's pieces, each read whole on rank 0 (collective:
    every rank reads the same keys in the same order; the other ranks get partial sums,
    to be ignored). Keys, shapes and dtypes are those of any rank's pieces."""

    def __init__(self, pieces: Mapping[str, ShardedTensor], device: torch.device) -> None:
        self.device = device
        self._pieces: dict[str, list[ShardedTensor]] = {}
        for piece in pieces.values():
            self._pieces.setdefault(piece.key, []).append(piece)
        mine = {key: (tuple(group[0].global_shape), str(group[0].data.dtype))
                for key, group in self._pieces.items()}  # fmt: skip
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        self._entries: dict[str, tuple[tuple[int, ...], str]] = {}
        for entries in every:
            self._entries.update(entries)
        self._last: tuple[str, torch.Tensor] | None = None

    @property
    def keys(self) -> list[str]:
        return sorted(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return getattr(torch, self._entries[key][1].removeprefix("torch."))

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        if self._last is None or self._last[0] != key:
            self._last = None  # dropped before the next one is made
            self._last = (key, self._gathered(key))
        whole = self._last[1]
        if region is None:
            return whole
        box = whole[tuple(slice(o, o + n) for o, n in zip(region.offset, region.shape,
                                                           strict=True))]  # fmt: skip
        if region.flattened_range is not None:
            start, end = region.flattened_range
            box = box.reshape(-1)[start:end]
        return box.clone()

    def _gathered(self, key: str) -> torch.Tensor:
        whole = torch.zeros(self.shape(key), dtype=self.dtype(key), device=self.device)
        for piece in self._pieces.get(key, ()):
            if piece.replica_id == 0:
                piece.write_into(whole)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.reduce(whole, dst=0, op=dist.ReduceOp.SUM)
        return whole.cpu()


def export_hf_from_pieces(
    pieces: Mapping[str, ShardedTensor],
    common: dict,
    out_dir: str | os.PathLike,
    *,
    device: torch.device,
    arch: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Writes the Hugging Face directory of the model the ranks' pieces make up (module
    docstring); `common` as a checkpoint's common.pt holds it (the model's settings, the
    family, the tokenizer record or the run's data config). Returns out_dir on every rank
    once it is in place. A refusal (the family, the settings, an out_dir that is not an
    earlier export) is raised on every rank before any tensor is gathered; a write that
    fails on rank 0 midway raises there."""
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial = out.with_name(f".{out.name}.partial")
    problem = None
    if rank == 0:
        try:
            check_export_target(out)
            if partial.exists():
                shutil.rmtree(partial)
        except OSError as error:
            problem = str(error)
    _agree(problem, out)
    # Every refusal (family, settings, tokenizer) comes before the first gathered tensor,
    # on every rank alike; the reads then run in the same order on every rank.
    source = GatheredPieces({k: p for k, p in pieces.items()
                             if not p.key.startswith("optimizer.")}, device)  # fmt: skip
    write_hf(source, source.keys, common, partial, arch, where="the run's model",
             write=rank == 0, dtype=dtype)  # fmt: skip
    if rank == 0:
        try:
            _replace(partial, out)
        except OSError as error:
            problem = str(error)
    _agree(problem, out)
    return out


def _agree(problem: str | None, out: Path) -> None:
    """Raises on every rank when rank 0 found a problem (collective)."""
    said = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(said, src=0)
    if said[0] is not None:
        raise OSError(f"the Hugging Face export to {out} failed on rank 0: {said[0]}")


def check_export_target(out_dir: str | os.PathLike) -> None:
    """Raises unless out_dir can take an export: absent, empty, or an earlier export (a
    directory with a config.json), which the export replaces."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export_hf_dir={out} exists and is not a directory")
    if out.exists() and not (out / "config.json").exists() and any(out.iterdir()):
        raise FileExistsError(
            f"export_hf_dir={out} holds files and no config.json (not an earlier export): "
            "it is left as it is; remove it or name another directory"
        )


def _replace(partial: Path, out: Path) -> None:
    """Moves the complete export into place; an earlier export there is removed once the
    new one is in place."""
    check_export_target(out)
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(partial, out)
    if old.exists():
        shutil.rmtree(old)
