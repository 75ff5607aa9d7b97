"""Reading a JSON-lines file, plain or gzip-compressed, as blocks of whole lines.

Preprocessing hands work to its workers a block at a time rather than a line
at a time: one block is about BLOCK_BYTES of complete lines, one pickled bytes
object, so the cost of passing it between processes is paid per megabyte,
not per document. The reader only cuts at newlines and counts them (memchr
speed); decoding and parsing happen in the workers.

Each block comes with the number of its first line (1-based, counting every
line of the file), so that an error found in a worker can name the line.
Compression is recognised by the gzip magic bytes, not the file name.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator

from mp_data.cli.errors import CliError

__all__ = ["BLOCK_BYTES", "InputFile"]

BLOCK_BYTES = 1 << 20
"""Bytes of text per block (a block grows past it only to finish a long line)."""

_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"


class InputFile:
    """A JSON-lines file at `path`, read once, front to back, by `blocks()`."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.isdir(path):
            raise CliError(f"{path}: is a directory, expected a .jsonl or .jsonl.gz file")
        if not os.path.isfile(path):
            raise CliError(f"{path}: no such input file")
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            self.compressed = f.read(2) == _GZIP_MAGIC
        self._raw = None
        self.lines_read = 0
        """Lines handed out so far (the last line number of the last block)."""

    def fraction_read(self) -> float | None:
        """How far through the file (on disk, so compressed bytes for .gz) reading is."""
        if self._raw is None or self.size == 0 or self._raw.closed:
            return None
        return min(1.0, self._raw.tell() / self.size)

    def blocks(self, block_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(number of the first line, bytes of whole lines) pairs, in file order."""
        block_bytes = block_bytes or BLOCK_BYTES
        with open(self.path, "rb") as raw:
            self._raw = raw
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if self.compressed else raw
            try:
                yield from self._cut(stream, block_bytes)
            except (OSError, EOFError, zlib.error) as e:
                # A truncated or corrupt .gz surfaces here, after the lines before it.
                raise CliError(
                    f"{self.path}: cannot read past line {self.lines_read}: {e}"
                ) from None

    def _cut(self, stream, block_bytes: int) -> Iterator[tuple[int, bytes]]:
        pending: list[bytes] = []  # the start of a line whose end is not read yet
        first = True
        while True:
            data = stream.read(block_bytes)
            if first:
                # Editors on Windows start UTF-8 files with a byte-order mark,
                # which JSON does not allow; it is not part of the first line.
                if data.startswith(_UTF8_BOM):
                    data = data[len(_UTF8_BOM) :]
                first = False
            if not data:
                break
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # inside a line longer than a block: keep reading it
                pending.append(data)
                continue
            head = data[:cut]
            if pending:
                head = b"".join([*pending, head])
                pending = []
            yield self._block(head)
            if cut < len(data):
                pending.append(data[cut:])
        if pending:  # the last line has no newline
            yield self._block(b"".join(pending))

    def _block(self, data: bytes) -> tuple[int, bytes]:
        first_line = self.lines_read + 1
        self.lines_read += data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
        return first_line, data
