"""keep_freed_memory: after it, steps that allocate and free the same large buffer
again reuse the pages of the steps before (no page faults once the heap holds them);
glibc's own variables win."""

import subprocess
import sys

import pytest

from mp_train.loop import cpu_allocator
from mp_train.loop.cpu_allocator import _mallopt

pytestmark = pytest.mark.skipif(_mallopt() is None, reason="glibc's mallopt only")

# A fresh process: mallopt is process-wide. Prints the minor page faults of writing a
# freshly malloc'd 64 MiB block, four times, each after the one before was freed.
_PROBE = """
import ctypes, importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("cpu_allocator", sys.argv[2])
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)  # the module alone: no torch to import
keep_freed_memory = allocator.keep_freed_memory
if sys.argv[1] == "keep":
    print(keep_freed_memory(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 * 2**20)
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*(faults() for _ in range(4)))
"""


def probe(mode: str, **env) -> list[int]:
    import os

    done = subprocess.run([sys.executable, "-c", _PROBE, mode, cpu_allocator.__file__],
                          capture_output=True, text=True, env={**os.environ, **env},
                          timeout=120, check=True)  # fmt: skip
    return [int(x) for x in done.stdout.split()]


def test_freed_pages_are_reused_by_the_next_steps():
    pages = 64 * 2**20 // 4096
    plain = probe("plain")
    assert all(n > pages // 2 for n in plain), plain  # mmap'd afresh every time
    kept = probe("keep")
    assert kept[0] > pages // 2 and all(n < pages // 20 for n in kept[1:]), kept


def test_glibcs_own_variables_rule():
    pages = 64 * 2**20 // 4096
    faults = probe("keep", MALLOC_MMAP_MAX_="65536")
    assert all(n > pages // 2 for n in faults), faults
