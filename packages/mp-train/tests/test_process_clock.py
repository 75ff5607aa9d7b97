"""The job's start for exit_duration_in_mins is the process's, read from Linux's /proc:
a process that waits 2 s before importing mp_train reports the start it was launched
at, not the import, and a process forked 2 s after the import (as the test launcher's
ranks are) its fork (btime has a resolution of one second)."""

import subprocess
import sys
import time

import pytest

CHILD = """
import os, time
time.sleep(2)
from mp_train.loop.process_clock import _IMPORTED, process_start_time
print(process_start_time(), _IMPORTED, flush=True)
time.sleep(2)
forked = time.time()
pid = os.fork()
if pid == 0:
    print(process_start_time(), forked, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_the_start_is_the_launch_or_the_fork_not_the_import():
    launched = time.time()
    printed = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                             check=True, timeout=300).stdout.splitlines()  # fmt: skip
    started, imported = map(float, printed[0].split())
    assert imported >= launched + 2
    assert launched - 1.5 <= started < imported - 1
    fork_started, forked = map(float, printed[1].split())
    assert forked >= imported + 2
    assert forked - 1.5 <= fork_started <= forked + 1.5
