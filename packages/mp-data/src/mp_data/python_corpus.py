"""A real-text corpus with no download: the documentation strings of installed Python code.

Every machine that runs mp has Python's standard library and the packages mp
depends on; their modules, classes and functions carry several megabytes of
English prose. `write_docstring_corpus` collects them (parsing the sources
with `ast`, never importing them) into a jsonl file of {"text": ...}
documents, in a fixed order, for demonstrations, tests and benchmarks.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator

__all__ = ["docstrings", "source_roots", "write_docstring_corpus"]

_MIN_CHARS = 80  # shorter docstrings are mostly "Return x." and add little text


def source_roots() -> list[str]:
    """The standard library, then the installed packages (site-packages)."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    return list(dict.fromkeys(r for r in roots if os.path.isdir(r)))


def docstrings(roots: list[str]) -> Iterator[str]:
    """Docstrings of at least 80 characters from every .py file under `roots`, sorted by path."""
    for root in roots:
        for folder, subfolders, files in os.walk(root):
            subfolders.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    yield from _file_docstrings(os.path.join(folder, name))


def _file_docstrings(path: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
        return  # test fixtures with deliberate errors, other encodings, unreadable files
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text and len(text) >= _MIN_CHARS:
                yield text


def write_docstring_corpus(path: str, min_bytes: int, roots: list[str] | None = None) -> int:
    """Writes at least `min_bytes` of {"text": docstring} lines to `path`; returns bytes written.

    Raises ValueError when the installed sources hold fewer. The file appears
    only complete (written under a temporary name, then renamed).
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".corpus.", suffix=".tmp", dir=folder)
    written = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for text in docstrings(roots or source_roots()):
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                if written >= min_bytes:
                    break
        if written < min_bytes:
            raise ValueError(
                f"the Python sources under {roots or source_roots()} hold only {written} bytes "
                f"of docstrings; {min_bytes} were asked for"
            )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return written


if __name__ == "__main__":  # python -m mp_data.python_corpus OUT.jsonl [MEGABYTES]
    size = int(float(sys.argv[2]) * 2**20) if len(sys.argv) > 2 else 20 * 2**20
    print(write_docstring_corpus(sys.argv[1], size), "bytes")
