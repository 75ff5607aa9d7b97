"""Megatron-LM's --spec MODULE FUNCTION (or `local`): the layer spec its pretrain_gpt.py and
pretrain_hybrid.py import to build the model (Megatron-LM's Mamba example passes its own
default, `megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec`). mp builds
its layers from the model's fields, so a spec of Megatron-LM's own layers changes nothing
(a hybrid model's needs --hybrid-layer-pattern, as that spec does); any other names code
mp does not run, and is refused.

    add_to(group)            the flag, in the group of flags accepted without effect
    check(given, values)     takes it out of the parsed options: True when given (for the
                             note listing such flags); raises for a spec mp cannot honour
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_to", "check"]

_DEST = "spec"
_LAYERS = {
    ("local",),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_with_transformer_engine_spec"),
}
"""Megatron-LM's GPT layer specs: local and Transformer Engine layers compute alike."""
_HYBRID = {
    ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"),
    ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),
}
"""Megatron-LM's hybrid (Mamba) stack specs, by their current and older module names."""


def add_to(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--spec", dest=_DEST, nargs="+", default=argparse.SUPPRESS, metavar="WORD",
        help="No effect for Megatron-LM's own layer specs (local, its GPT layer specs, its "
        "hybrid stack spec with --hybrid-layer-pattern): mp builds its layers from the "
        "model's fields. Another module is refused.",
    )  # fmt: skip


def check(given: dict[str, Any], values: dict[str, dict[str, Any]]) -> bool:
    """Takes --spec out of `given` (the parsed options; `values`: the fields so far, a
    YAML file's among them); True when it was given. Raises, naming the spec, for one mp
    cannot honour."""
    if _DEST not in given:
        return False
    words = tuple(
        w for word in given.pop(_DEST) for w in word.strip("[]").replace(",", " ").split()
    )
    if words in _LAYERS:
        return True
    pattern = given.get("hybrid_layer_pattern", given.get("hybrid_override_pattern"))
    pattern = pattern or values["model"].get("hybrid_layer_pattern")
    if words in _HYBRID:
        if pattern is None:
            raise ValueError(
                f"--spec {' '.join(words)}: Megatron-LM's hybrid stack builds the layers of "
                "--hybrid-layer-pattern, which is not given"
            )
        return True
    raise ValueError(
        f"--spec {' '.join(words)}: a layer spec of its own, code mp does not run; mp builds "
        "its layers from the model's fields (its attention, MLP and norm flags): drop it"
    )
