"""Offline conversion of a checkpoint to another TP x PP layout (or one consolidated set).

    mp-ckpt convert DIR OUT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Every logical tensor is cut for the target layout (gpt_layout.py says how)
and written tensor by tensor: the DCP writer asks for each piece only when
it writes it, and the piece is read from the overlapping saved chunks just
then, so memory stays near the largest tensor plus one chunk. Optimizer
states are written as whole boxes (a distributed optimizer's flat ranges
depend on the run's buffers; the loader cuts them again). The output is an
mp-ckpt checkpoint under OUT (iter_XXXXXXX/ and the tracker).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from mp_ckpt.core.checkpointer import METADATA, build_metadata, replace_dir, single_process_quiet
from mp_ckpt.core.gpt_layout import layer_index, stage_of, tp_axis
from mp_ckpt.core.integrity import CHECKSUMS, HashingFileSystemWriter
from mp_ckpt.core.layout import checkpoint_dir, fsync_dir, write_tracker
from mp_ckpt.core.progress import progress as progress_reporter
from mp_ckpt.core.reader import CheckpointReader
from mp_ckpt.core.regions import Region

__all__ = ["convert_checkpoint", "write_streaming"]


class _StreamingPlanner(DefaultSavePlanner):
    """Produces each tensor when the writer reaches it (the state dict holds meta tensors).

    The writer (one thread, one file per tensor) keeps its last tensor referenced while
    it asks for the next one, so two pieces would live at once beside the read of the
    second. Each tensor has been written and its file closed when the next is asked
    for: its memory is released then (its storage emptied), and the writer would fail
    loudly, never write wrong data, if it ever touched it again.
    """

    def __init__(self, producers: dict[str, Callable[[], torch.Tensor]], progress) -> None:
        super().__init__()
        self.producers = producers
        self.progress = progress
        self._last: torch.Tensor | None = None

    def resolve_data(self, write_item):
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
            self._last = None
        tensor = self.producers[write_item.index.fqn]()
        self.progress()
        self._last = tensor
        return tensor


def convert_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    iteration: int | None = None,
    progress: bool = True,
) -> Path:
    """Writes `source` (a checkpoint root or iteration directory) under `out` for the layout."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor ({tp}) and pipeline ({pp}) model-parallel sizes must be >= 1")
    reader = CheckpointReader(source, iteration=iteration)
    layer_stages = _layer_stages(reader.keys, pp)
    chunks_per_rank: list[list[dict]] = [[] for _ in range(tp * pp)]
    producers: dict[str, Callable[[], torch.Tensor]] = {}
    plan: dict[str, torch.Tensor] = {}
    for key in reader.keys:
        shape, dtype = reader.shape(key), reader.dtype(key)
        axis = tp_axis(key)
        if axis is not None and shape[axis] % tp:
            raise ValueError(
                f"{key}: axis {axis} of {shape} is not divisible by tensor_model_parallel_size={tp}"
            )
        for stage in stage_of(key, layer_stages, pp) if pp > 1 else [0]:
            for tp_rank in range(tp if axis is not None else 1):
                offset, piece_shape = [0] * len(shape), list(shape)
                if axis is not None:
                    piece_shape[axis] = shape[axis] // tp
                    offset[axis] = tp_rank * piece_shape[axis]
                region = Region(tuple(offset), tuple(piece_shape))
                name = f"{key}@{','.join(map(str, offset))}"
                plan[name] = torch.empty(piece_shape, dtype=dtype, device="meta")
                producers[name] = lambda k=key, r=region: reader.read(k, r)
                chunks_per_rank[stage * tp + tp_rank].append({
                    "key": key, "storage_key": name, "dtype": str(dtype).removeprefix("torch."),
                    "global_shape": list(shape), "offset": offset, "shape": piece_shape,
                    "flattened_range": None,
                })  # fmt: skip

    common = torch.load(reader.directory / "common.pt", weights_only=False)
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
              "converted_from": str(reader.directory)}  # fmt: skip
    return write_streaming(out, reader.iteration, plan, producers, chunks_per_rank, common,
                           layout, progress=progress, description="convert")  # fmt: skip


def write_streaming(
    out: str | os.PathLike,
    iteration: int,
    plan: dict[str, torch.Tensor],
    producers: dict[str, Callable[[], torch.Tensor]],
    chunks_per_rank: list[list[dict]],
    common: dict,
    layout: dict | None,
    *,
    progress: bool = False,
    description: str = "write",
) -> Path:
    """Writes checkpoint `iteration` under `out`, one stored tensor at a time: `plan` maps
    each storage key to a meta tensor of its shape and dtype, `producers` to the function
    that makes it (called when the writer reaches it; released once written);
    chunks_per_rank is what mp_metadata.json records for each rank of the layout.
    progress: report the tensors written on stderr (progress.py), as `description`."""
    final = checkpoint_dir(out, iteration)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bar = progress_reporter(len(plan), description, unit="tensor", enabled=progress)
    with single_process_quiet():
        # One file per tensor: DCP keeps every tensor written to a file referenced until
        # the file closes, so a single file would hold the whole model in memory. One
        # thread: _StreamingPlanner releases each tensor when the next is asked for.
        writer = HashingFileSystemWriter(tmp, thread_count=1, single_file_per_rank=False)
        dcp.save(plan, storage_writer=writer,
                 planner=_StreamingPlanner(producers, bar.update), no_dist=True)  # fmt: skip
    bar.close()
    torch.save(common, tmp / "common.pt")
    metadata = build_metadata(iteration, chunks_per_rank, len(chunks_per_rank), layout)
    (tmp / METADATA).write_text(json.dumps(metadata, indent=1))
    files = {p.name: writer.digest(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / CHECKSUMS).write_text(json.dumps(files, indent=1, sort_keys=True))
    fsync_dir(tmp)
    replace_dir(tmp, final)
    write_tracker(out, iteration)
    return final


def _layer_stages(keys: list[str], pp: int) -> list[int]:
    indices = {i for i in map(layer_index, keys) if i is not None}
    layers = max(indices) + 1 if indices else 0
    if layers % pp:
        raise ValueError(
            f"{layers} layers cannot be split evenly over pipeline_model_parallel_size={pp}"
        )
    per_stage = layers // pp
    return [i // per_stage for i in range(layers)]
