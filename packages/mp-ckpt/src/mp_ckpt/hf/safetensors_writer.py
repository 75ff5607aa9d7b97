"""Writing safetensors files one tensor at a time, sharded by size.

safetensors' own save_file takes a dict of every tensor of a file, so a 5 GB
shard would sit in memory whole. Here each tensor's bytes go to the shard's
data file as soon as the tensor is produced, and the shard is finished by
writing the header (known only then) followed by the data. Memory stays at one
tensor; the price is copying each shard's data once more on disk.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of JSON ({name: {dtype, shape, data_offsets}, plus
"__metadata__"}), padded with spaces to a multiple of 8, then the raw
little-endian bytes, offsets relative to the end of the header.

Files are written under temporary names and renamed once every shard is
complete: model.safetensors alone, or model-0000i-of-0000n.safetensors with
model.safetensors.index.json.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import torch

__all__ = ["ShardedSafetensorsWriter"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
_COPY_BLOCK = 16 << 20


class ShardedSafetensorsWriter:
    """with ShardedSafetensorsWriter(out_dir, max_shard_bytes) as writer:
    writer.add(name, tensor) ...   (the files appear when the block ends without error)"""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int,
                 metadata: dict[str, str] | None = None) -> None:  # fmt: skip
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; this machine is not")
        self.out = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = metadata or {"format": "pt"}
        self._finished: list[tuple[Path, dict[str, dict], int]] = []  # (tmp file, entries, bytes)
        self._data = None
        self._entries: dict[str, dict] = {}
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Appends a tensor (written now; not kept)."""
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: safetensors has no dtype for {tensor.dtype}")
        if any(name in entries for _, entries, _ in self._finished) or name in self._entries:
            raise ValueError(f"{name} is written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._entries and self._size + nbytes > self.max_shard_bytes:
            self._finish_shard()
        if self._data is None:
            self._data = open(self._tmp(f"data{len(self._finished)}"), "wb")  # noqa: SIM115
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._data.write(memoryview(raw))
        self._entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._size, self._size + nbytes],
        }
        self._size += nbytes

    def close(self) -> list[Path]:
        """Finishes the last shard and renames every file into place, replacing an
        earlier export's files; returns the files."""
        if self._entries or not self._finished:
            self._finish_shard()
        count = len(self._finished)
        if count == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        if count > 1:
            index = {
                "metadata": {"total_size": sum(size for _, _, size in self._finished)},
                "weight_map": {
                    tensor: name
                    for name, (_, entries, _) in zip(names, self._finished, strict=True)
                    for tensor in entries
                },
            }
            tmp_index = self._tmp("index")
            tmp_index.write_text(json.dumps(index, indent=2))
        earlier = set(self.out.glob("model*.safetensors")) | set(
            self.out.glob("model.safetensors.index.json"))  # fmt: skip
        paths = []
        for name, (tmp, _, _) in zip(names, self._finished, strict=True):
            os.replace(tmp, self.out / name)
            paths.append(self.out / name)
        if count > 1:
            os.replace(tmp_index, self.out / "model.safetensors.index.json")
            paths.append(self.out / "model.safetensors.index.json")
        for stale in earlier - set(paths):  # an earlier export's other shards
            stale.unlink()
        return paths

    def abort(self) -> None:
        """Removes the temporary files."""
        if self._data is not None:
            self._data.close()
        for path in self.out.glob(".mp-ckpt-export-*.tmp"):
            path.unlink(missing_ok=True)

    def __enter__(self) -> ShardedSafetensorsWriter:
        self.out.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _finish_shard(self) -> None:
        data_path = self._tmp(f"data{len(self._finished)}")
        if self._data is not None:
            self._data.close()
            self._data = None
        else:
            data_path.write_bytes(b"")
        header = json.dumps({"__metadata__": self.metadata, **self._entries},
                            separators=(",", ":")).encode()  # fmt: skip
        header += b" " * (-len(header) % 8)
        shard = self._tmp(f"shard{len(self._finished)}")
        with open(shard, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, _COPY_BLOCK)
            out.flush()
            os.fsync(out.fileno())  # on disk before it is renamed into place
        data_path.unlink()
        self._finished.append((shard, self._entries, self._size))
        self._entries, self._size = {}, 0

    def _tmp(self, what: str) -> Path:
        return self.out / f".mp-ckpt-export-{what}.tmp"
