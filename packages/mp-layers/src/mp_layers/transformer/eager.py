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

_marked: list[Callable] = []
_disabled: dict[Callable, Callable] = {}


def eager_when_compiled(function: Callable) -> Callable:
    """`function`, run eagerly when a compiled region calls it."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            # Not armed (a layer compiled by other means): disabled now, at trace time.
            eager = _disabled.get(function) or torch.compiler.disable(function)
            return eager(*args, **kwargs)
        return function(*args, **kwargs)

    _marked.append(function)
    return wrapper


def arm_eager_functions() -> None:
    """Makes the disabled versions of the functions marked eager_when_compiled."""
    for function in _marked:
        if function not in _disabled:
            _disabled[function] = torch.compiler.disable(function)
