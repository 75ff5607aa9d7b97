"""Megatron-LM's CUDA graph flags. mp captures no CUDA graph (its GPU path compiles each
layer instead: --torch-compile). So --cuda-graph-impl none (Megatron-LM's default) and the
flags that only tune a capture (--cuda-graph-modules, --cuda-graph-scope,
--cuda-graph-warmup-steps, which Megatron-LM reads only with one) change nothing; a capture
asked for (--cuda-graph-impl local, transformer_engine or full_iteration, or the
deprecated --enable-cuda-graph and --external-cuda-graph) is refused.

    add_to(group)             the flags, in the group of flags accepted without effect
    check(given) -> [flags]   takes them out of the parsed options; returns those given
                              that change nothing; raises for a capture asked for
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_to", "check"]

_IMPL = "cuda_graph_impl"
_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
_TUNING = ("cuda_graph_modules", "cuda_graph_scope", "cuda_graph_warmup_steps")
_DEPRECATED = ("enable_cuda_graph", "external_cuda_graph")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_to(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        _option(_IMPL), dest=_IMPL, choices=_IMPLS, default=argparse.SUPPRESS,
        help="none: no effect (mp captures no CUDA graph; --torch-compile compiles the "
        "layers); the others are refused.",
    )  # fmt: skip
    tunes = "No effect: tunes a CUDA graph capture, which mp does not make."
    for dest in _TUNING:
        group.add_argument(_option(dest), dest=dest, nargs="+", default=argparse.SUPPRESS,
                           metavar="X", help=tunes)  # fmt: skip
    asks = "Refused: a CUDA graph capture (Megatron-LM's deprecated switch), which mp lacks."
    for dest in _DEPRECATED:
        group.add_argument(_option(dest), dest=dest, action="store_true",
                           default=argparse.SUPPRESS, help=asks)  # fmt: skip


def check(given: dict[str, Any]) -> list[str]:
    """Takes the flags out of `given`; returns those given that change nothing. Raises,
    naming the flag, where one asks for a capture."""
    impl = given.pop(_IMPL, None)
    asked = [_option(dest) for dest in _DEPRECATED if given.pop(dest, False)]
    if impl not in (None, "none"):
        asked.insert(0, f"{_option(_IMPL)} {impl}")
    tuning = [_option(dest) for dest in _TUNING if given.pop(dest, None) is not None]
    if asked:
        raise ValueError(
            f"{asked[0]}: a CUDA graph capture, which mp does not make (its GPU path compiles "
            "each layer: --torch-compile); drop it"
        )
    return ([_option(_IMPL)] if impl == "none" else []) + tuning
