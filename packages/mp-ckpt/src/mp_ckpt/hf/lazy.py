"""A Hugging Face directory read straight into a run's pieces, without an mp checkpoint.

    is_hf_directory(path)             config.json with a model_type, safetensors, no tracker
    hf_directory_settings(path)       (config.json as the weights show it, mp's settings)
    load_hf_pieces(path, pieces)      fills this rank's pieces; returns common-style
                                      {"family", "tokenizer", "generation_config"}

Each rank walks its family's rules (importer.iter_logical_from_hf) over the weight
files' headers and reads, a rule at a time, only the Hugging Face tensors of the rules
whose logical tensors it holds a piece of; each logical tensor is made whole, its
pieces copied out (ShardedTensor.read_from) and dropped before the next rule. So a
rank's memory beyond its model is one rule's tensors (a layer's experts for a
per-expert rule), and a pipeline stage reads only its own layers' tensors. A rank
reads whole Hugging Face tensors, not only its tensor-parallel slice of them: the
family's transforms are written for whole tensors.

The weights stay memory-mapped (safetensors' safe_open); the family's `prepare` hook
(renames; transformers' fused experts split into per-expert views) runs over meta
tensors of the files' shapes, and each tensor it yields is read as the view of a
stored tensor that it is. A hook that computes a tensor rather than viewing one is
refused: such a directory converts with `mp-ckpt import-hf` first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from mp_ckpt.core.layout import read_tracker
from mp_ckpt.core.sharding import ShardedTensor
from mp_ckpt.families import family
from mp_ckpt.hf.importer import (
    held_config,
    iter_logical_from_hf,
    model_config_from_hf,
    read_hf_config,
    read_json,
)
from mp_ckpt.hf.tokenizer import tokenizer_from_hf

__all__ = [
    "LazySafetensors",
    "hf_directory_settings",
    "is_hf_directory",
    "load_hf_pieces",
]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip


def is_hf_directory(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a Hugging Face model directory: a config.json naming a
    model_type and no mp tracker file (an mp checkpoint root is never one)."""
    if path is None:
        return False
    path = Path(path)
    if not (path / "config.json").is_file() or read_tracker(path) is not None:
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "model_type" in config


def hf_directory_settings(path: str | os.PathLike) -> tuple[dict, dict]:
    """(config.json as the weights show it, mp's model settings under Megatron's names)
    of a Hugging Face directory, reading the weight files' headers only."""
    path = Path(path)
    config = read_hf_config(path)
    config = held_config(LazySafetensors(path), config)
    return config, model_config_from_hf(config)


class LazySafetensors(Mapping):
    """A directory's safetensors as a mapping of name -> a meta tensor of its shape and
    dtype; read(value) gives the stored tensor that value is (or is a view of)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index, "")["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"{path} holds no model.safetensors nor model.safetensors.index.json: a "
                "Hugging Face directory loads from safetensors (convert pytorch_model.bin "
                "with `mp-ckpt import-hf` first)"
            )
        self._handles: dict[str, object] = {}
        self._metas: dict[str, torch.Tensor] = {}
        self._file_of: dict[str, str] = {}
        self._name_of: dict[int, str] = {}
        for file in files:
            if not (path / file).exists():
                raise FileNotFoundError(f"{path / file} (named in {index.name}) is missing")
            handle = safe_open(str(path / file), framework="pt")
            self._handles[file] = handle
            names = handle.keys()  # a safe_open handle is not iterable
            for name in names:
                stored = handle.get_slice(name)
                dtype = _DTYPES.get(stored.get_dtype(), torch.float32)
                meta = torch.empty(stored.get_shape(), dtype=dtype, device="meta")
                self._metas[name], self._file_of[name] = meta, file
                self._name_of[id(meta)] = name
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._metas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._metas)

    def __len__(self) -> int:
        return len(self._metas)

    def read(self, value: torch.Tensor) -> torch.Tensor:
        """The stored tensor `value` (one of this mapping's meta tensors, or a view of one
        made by a family's prepare hook) stands for."""
        name = self._name_of.get(id(value))
        if name is not None:
            return self._stored(name)
        base = value._base if value.is_meta else None
        name = self._name_of.get(id(base)) if base is not None else None
        if name is None:
            raise ValueError(
                "the family's prepare hook computed a tensor from the Hugging Face weights "
                "instead of viewing one: load this directory through `mp-ckpt import-hf`"
            )
        # One stored tensor read for all its views in turn (transformers' fused experts).
        if self._last is None or self._last[0] != name:
            self._last = (name, self._stored(name))
        return self._last[1].as_strided(value.shape, value.stride(), value.storage_offset())

    def _stored(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)


def load_hf_pieces(path: str | os.PathLike, pieces: Mapping[str, ShardedTensor]) -> dict:
    """Fills `pieces` (this rank's, as for load_checkpoint) from the Hugging Face directory
    `path` (module docstring). Collective under torch.distributed: a problem found on any
    rank (a tensor no rule makes, a Hugging Face tensor with no place) is raised on every
    rank. Returns {"family", "tokenizer", "generation_config"} as import-hf records them."""
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    by_key: dict[str, list[ShardedTensor]] = {}
    for piece in pieces.values():
        by_key.setdefault(piece.key, []).append(piece)
    made: set[str] = set()
    error = None
    try:
        config = read_hf_config(path)
        state = LazySafetensors(path)
        with torch.no_grad():
            for name, tensor in iter_logical_from_hf(state, config, wanted=by_key.__contains__,
                                                     read=state.read):  # fmt: skip
                made.add(name)
                for piece in by_key[name]:
                    _fill(piece, tensor, path)
        missing = sorted(set(by_key) - made)
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if
                                              len(missing) > 4 else "")  # fmt: skip
            raise KeyError(f"{path}: the model needs {shown}, which the Hugging Face "
                           f"weights do not hold")  # fmt: skip
    except (KeyError, ValueError, FileNotFoundError) as caught:
        error = caught
    _raise_on_every_rank(error, distributed)
    config = held_config(state, config)
    generation = None
    if (path / "generation_config.json").exists():
        generation = read_json(path / "generation_config.json", "")
    common = {"family": family(config["model_type"]).model_type,
              "tokenizer": tokenizer_from_hf(path, config, generation)}  # fmt: skip
    if generation is not None:
        common["generation_config"] = generation
    return common


def _fill(piece: ShardedTensor, tensor: torch.Tensor, path: Path) -> None:
    if tuple(tensor.shape) != tuple(piece.global_shape):
        raise ValueError(
            f"{path}: {piece.key} is {tuple(tensor.shape)} in the Hugging Face weights, "
            f"{tuple(piece.global_shape)} in this model"
        )
    box = tensor[piece.global_slices]
    if piece.flattened_range is not None:
        start, end = piece.flattened_range
        box = box.reshape(-1)[start:end]
    piece.data.copy_(box)


def _raise_on_every_rank(error: BaseException | None, distributed: bool) -> None:
    if not distributed:
        if error is not None:
            raise error
        return
    found = [None] * dist.get_world_size()
    said = None if error is None else (type(error).__name__, _message(error))
    dist.all_gather_object(found, said)
    first = next(((rank, e) for rank, e in enumerate(found) if e is not None), None)
    if first is None:
        return
    rank, (kind, message) = first
    if error is not None:
        raise error
    kinds = {"KeyError": KeyError, "FileNotFoundError": FileNotFoundError}
    raise kinds.get(kind, ValueError)(f"rank {rank}: {message}")


def _message(error: BaseException) -> str:
    # A KeyError's str() quotes its message.
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
