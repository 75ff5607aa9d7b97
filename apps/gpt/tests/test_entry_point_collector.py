"""Run as a program, pretrain imports with the cyclic garbage collector off (its modules'
objects live as long as the process) and runs with it on: both entry points."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # conftest.py runs it first

SCRIPT = Path(__file__).resolve().parents[1] / "pretrain_gpt.py"

# Run in a child: `mp_gpt.gpt`'s import records whether the collector is on (an import
# hook ahead of it), load_config whether it is on once main() starts, then the run stops.
PROBE = """
import gc, importlib.abc, runpy, sys
import mp_train
seen = {}
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mp_gpt.gpt":
            seen["importing"] = gc.isenabled()
        return None
def load_config(argv=None):
    seen["running"] = gc.isenabled()
    raise SystemExit(0)
sys.meta_path.insert(0, Probe())
mp_train.load_config = load_config
try:
    if sys.argv[1] == "module":
        runpy.run_module("mp_gpt.pretrain", run_name="__main__")
    else:
        runpy.run_path(sys.argv[1], run_name="__main__")
finally:
    print(seen)
"""


@pytest.mark.parametrize("entry", ["module", "script"])
def test_the_collector_is_off_while_importing_and_on_for_the_run(entry):
    target = "module" if entry == "module" else str(SCRIPT)
    done = subprocess.run([sys.executable, "-c", PROBE, target], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "{'importing': False, 'running': True}"
