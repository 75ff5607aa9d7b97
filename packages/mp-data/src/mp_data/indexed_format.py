"""Megatron's MMIDIDX index format (version 1): dtype codes, header, validation.

A prefix P names P.bin (the token arrays of every sequence, concatenated, in
one dtype) and P.idx (little-endian, no padding):

    offset       type     content
    0            9 bytes  magic b"MMIDIDX\\x00\\x00"
    9            u64      version, 1
    17           u8       dtype code of the tokens in P.bin
    18           u64      S, the number of sequences
    26           u64      D, the number of documents + 1
    34           i32[S]   sequence lengths, in tokens
    34 + 4S      i64[S]   sequence pointers: byte offset of each sequence in P.bin
    34 + 12S     i64[D]   document indices: sequence boundaries, 0 ... S
    34 + 12S+8D  i8[S]    sequence modes, multimodal datasets only (unmarked)
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "DType",
    "IndexHeader",
    "get_bin_path",
    "get_idx_path",
    "read_header",
]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34


class DType(enum.IntEnum):
    """Megatron's dtype codes for the tokens of a .bin file."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: np.dtype | type) -> int:
        name = np.dtype(dtype).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} has no MMIDIDX code; codes exist for {_names()}")
        return int(cls[name])

    @classmethod
    def dtype_from_code(cls, code: int) -> np.dtype:
        if code not in cls._value2member_map_:
            raise ValueError(f"unknown dtype code {code}; known codes are 1-8 ({_names()})")
        return np.dtype(cls(code).name)

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type:
        """Megatron's token dtype for a vocabulary: uint16 below 65,500 entries, else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def _names() -> str:
    return ", ".join(f"{m.value} {m.name}" for m in DType)


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequence_count: int
    document_count: int  # D: documents + 1 boundaries

    def pack(self) -> bytes:
        code = DType.code_from_dtype(self.dtype)
        return _HEADER.pack(MAGIC, VERSION, code, self.sequence_count, self.document_count)

    @property
    def body_size(self) -> int:
        """Bytes of the arrays after the header, without sequence modes."""
        return 12 * self.sequence_count + 8 * self.document_count


def read_header(data: bytes | memoryview, path: str) -> IndexHeader:
    """Parses and checks the header of the .idx file at `path` (for the messages)."""
    if len(data) < HEADER_SIZE:
        raise ValueError(
            f"{path}: {len(data)} bytes is too short for an MMIDIDX header ({HEADER_SIZE} bytes)"
        )
    magic, version, code, sequences, documents = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic {magic!r}, expected {MAGIC!r}: not an MMIDIDX index")
    if version != VERSION:
        raise ValueError(f"{path}: index version {version} is not supported (only {VERSION})")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if documents < 1:
        raise ValueError(f"{path}: document count {documents} must be >= 1 (boundaries 0 ... S)")
    return IndexHeader(dtype, sequences, documents)
