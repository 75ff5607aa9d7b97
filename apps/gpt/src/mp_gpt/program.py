"""How mp_gpt's programs (`pretrain`, `serve`) start, run as `python -m` or under torchrun.

Their imports make some 290,000 objects that live as long as the process; the cyclic
collector would scan them over and over while they come (0.3 s of the 3 s of CPU that
`pretrain --help` takes on a 2-core machine), and again at every full collection of the
run after (0.55 s of a tiny torchrun rank's 3.8 s). So a program calls `imports_begin()`
before its imports and `run(main)` after them: the collector is off while they come, then
they are frozen out of its collections. They are unfrozen at the end, as frozen objects
outlive the interpreter's last collection and triton's bindings report them as leaked.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

__all__ = ["imports_begin", "run"]


def imports_begin() -> None:
    """The collector off until `run`."""
    gc.disable()


def run(main: Callable[[], int]) -> int:
    """main()'s status, with what exists now frozen and the collector on."""
    gc.freeze()
    gc.enable()
    try:
        return main()
    finally:
        gc.unfreeze()
