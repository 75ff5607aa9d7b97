"""Functions that stay eager inside a compiled layer (compiled.py): Dynamo breaks the
graph at each call and runs the function as Python, the code it calls included.

    @eager_when_compiled
    def context_parallel_attention(...): ...

The same as decorating with torch.compiler.disable, except for when torch's compiler
is imported: torch.compiler.disable imports it (seconds) at decoration, so into every
program that imports mp_layers, compiling or not. Here the disabled function is made by
arm_eager_functions(), which compile_layers calls before anything is traced; outside a
compiled region the wrapper calls the function directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["arm_eager_functions", "eager_when_compiled"]

_arms: list[Callable[[], None]] = []


def eager_when_compiled(function: Callable) -> Callable:
    """`function`, run eagerly when a compiled region calls it."""
    # Each wrapper holds its own disabled function in a closure cell, which Dynamo reads
    # and guards as the wrapper's own. Looked up in a table keyed by the function, as it
    # was, Dynamo (torch 2.15) took the first lookup's result for every later wrapper of
    # one compiled region whose function shared its code (closures of one factory): the
    # second such function's call ran the first.
    eager = None

    def arm() -> None:
        nonlocal eager
        if eager is None:
            eager = torch.compiler.disable(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            # Not armed (a layer compiled by other means): disabled now, at trace time.
            return (eager or torch.compiler.disable(function))(*args, **kwargs)
        return function(*args, **kwargs)

    _arms.append(arm)
    return wrapper


def arm_eager_functions() -> None:
    """Makes the disabled versions of the functions marked eager_when_compiled."""
    for arm in _arms:
        arm()
