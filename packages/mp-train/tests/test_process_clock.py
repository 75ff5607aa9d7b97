"""The job's start for exit_duration_in_mins is the process's, read from Linux's /proc:
a process that waits 2 s before importing mp_train reports the start it was launched
at, not the import (btime has a resolution of one second)."""

import subprocess
import sys
import time

import pytest

CHILD = """
import time
time.sleep(2)
from mp_train.loop.process_clock import _IMPORTED, process_start_time
print(process_start_time(), _IMPORTED)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_the_start_is_the_launch_not_the_import():
    launched = time.time()
    printed = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             check=True, timeout=300).stdout  # fmt: skip
    started, imported = map(float, printed.split())
    assert imported >= launched + 2
    assert launched - 1.5 <= started < imported - 1
