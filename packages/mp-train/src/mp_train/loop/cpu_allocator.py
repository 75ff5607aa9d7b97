"""glibc's allocator on CPU runs: what a step frees stays for the next step.

A training step allocates and frees the same large buffers every time: activations and
their gradients, the logits, and under FSDP each layer's gathered parameters and the
inputs of its gradient reduction. glibc's malloc serves a block above its mmap
threshold (128 KiB, rising with the blocks freed to at most 32 MiB) with fresh pages of
its own mapping, unmapped when freed, and hands the top of its heap back to the kernel
once more than the trim threshold is free there. Either way the next step touches pages
the kernel must fault in and zero again: on the 2-core CPU of docs/benchmarks.md this
cost ZeRO-3 at DP2 about a quarter of its step (docs/fsdp.md, "Memory and speed").

`keep_freed_memory()`, called on CPU runs as torch.distributed comes up, tells malloc
to serve every block from its heap (M_MMAP_MAX 0) and to keep what is freed there
(M_TRIM_THRESHOLD 2 GiB, the largest it takes), so a step reuses the pages of the one
before. The price: blocks kept in the heap fragment it, and the resident set's peak
grows (docs/fsdp.md measures both); malloc_trim(0) still returns the free pages.
glibc's own variables rule where set (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_:
nothing is changed then; MALLOC_MMAP_MAX_=65536 keeps glibc's default), and it does
nothing on other C libraries (macOS, musl) or GPU runs.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_MAX = -4
_KEEP = 2**31 - 1  # mallopt's value is an int
_OWN_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> str:
    """Sets glibc's malloc to keep freed memory for reuse (module docstring); returns
    what was done, for the log."""
    given = [name for name in _OWN_VARIABLES if name in os.environ]
    if given:
        return f"left as the environment sets it ({', '.join(given)})"
    mallopt = _mallopt()
    if mallopt is None:
        return "left as it is (not glibc)"
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _KEEP)):
        return "left as it is (mallopt refused)"
    return "keeps freed memory for the next step (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB)"


def _mallopt():
    try:
        # The process's own symbols: the C library it runs on, found without
        # ctypes.util.find_library's `ldconfig -p` child process.
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return lambda option, value: bool(mallopt(option, value))
