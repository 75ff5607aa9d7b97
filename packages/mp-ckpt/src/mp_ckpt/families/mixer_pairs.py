"""Layers that are a mixer then an MLP (Granite 4's, Bamba's): each Hugging Face layer j is
two of mp's hybrid layers, 2j its mixer (M, a Mamba-2 mixer, or *, attention) behind the
layer's input_layernorm and 2j + 1 its MLP (- or E) behind the layer's second norm.

    mixer_rules(layer)       the rules of the mixers: the Mamba mixer under `layer`mamba.
                             (mamba_rules.py), attention under `layer`self_attn. (Llama's),
                             each behind `layer`input_layernorm
    pair_layer(settings, i)  the Hugging Face layer of mp's layer i (a Family's hf_layer)
    mixers(settings, ...)    each Hugging Face layer's mixer symbol and the MLPs' symbol of a
                             hybrid_layer_pattern, refusing one that is not such pairs
    is_mixer_pairs(pattern)  whether it is such pairs
"""

from __future__ import annotations

from dataclasses import replace

from mp_ckpt.families.llama_style import attention_rules
from mp_ckpt.families.mamba_rules import mamba_rules
from mp_ckpt.families.table import Rule, split_hybrid_pattern

__all__ = ["is_mixer_pairs", "mixer_rules", "mixers", "pair_layer"]


def mixer_rules(layer: str) -> tuple[Rule, ...]:
    return (
        *mamba_rules(layer + "mamba.", layer + "input_layernorm.weight"),
        Rule(("input_layernorm.weight",), layer + "input_layernorm.weight", "attention"),
        *(replace(rule, scope="attention") for rule in attention_rules()),
    )


def pair_layer(settings: dict, i: int) -> int:
    return i // 2


def is_mixer_pairs(pattern: str, mlps: str = "-E") -> bool:
    """Whether a hybrid_layer_pattern is such pairs, of one MLP kind of `mlps`."""
    return _pairs(pattern, mlps) is not None


def mixers(settings: dict, model_type: str, mlps: str) -> tuple[str, str]:
    """(the mixer symbol of each Hugging Face layer, the one MLP symbol of them all, one of
    `mlps`) of the settings' hybrid_layer_pattern."""
    pattern = settings["hybrid_layer_pattern"]
    pairs = _pairs(pattern, mlps)
    if pairs is None:
        raise ValueError(
            f"model_config hybrid_layer_pattern={pattern!r}: {model_type} layers are a mixer "
            f"(M or *) then an MLP ({' or '.join(mlps)}), the same kind in every layer, "
            "without multi-token prediction"
        )
    return "".join(p[0] for p in pairs), pairs[0][1]


def _pairs(pattern: str, mlps: str) -> list[str] | None:
    main, _, depths = split_hybrid_pattern(pattern)
    pairs = [main[k : k + 2] for k in range(0, len(main), 2)]
    alike = len({pair[1:] for pair in pairs}) == 1
    paired = all(len(p) == 2 and p[0] in "M*" and p[1] in mlps for p in pairs)
    return pairs if pairs and not depths and alike and paired else None
