"""Index arrays built in memory (datasets without a cache folder: mock data), kept for
the rest of the process.

A second dataset with the same settings in the same process, or in a process forked
from one that built them (a test launcher's ranks), takes the arrays already built:
Megatron's mock corpus holds 3.2 million samples of 64 tokens, whose three splits'
shuffles and sample indices cost about 0.15 s and 40 MB to build. The key is the dataset's
description with its sample count replaced by what the count decides, the epochs and
whether the last one is shuffled apart: counts within one epoch build the same arrays.
The arrays are read-only, as the memory-mapped ones of a cache folder are.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

__all__ = ["INDICES_KEPT", "built_in_memory", "kept_indices"]

INDICES_KEPT = 6
"""Entries kept; the least recently used goes first."""

_built: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
_lock = threading.Lock()


def built_in_memory(key: dict, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays built for `key` (JSON-able) in this process, building them on a miss."""
    text = json.dumps(key, sort_keys=True)
    with _lock:  # the builder may make datasets in threads
        arrays = _built.get(text)
        if arrays is not None:
            _built.move_to_end(text)
            return arrays
    arrays = build()
    for array in arrays.values():
        array.flags.writeable = False
    with _lock:
        _built[text] = arrays
        while len(_built) > INDICES_KEPT:
            _built.popitem(last=False)
    return arrays


def kept_indices() -> list[str]:
    """The keys (JSON) of the entries kept, the least recently used first."""
    with _lock:
        return list(_built)
