"""Megatron-LM's pipeline layout string (--pipeline-model-parallel-layout).

"Et*3|(tt|)*6mL" lists what each virtual pipeline stage holds, stages separated by "|",
in virtual-stage order (stage c * pp + r is chunk c of pipeline rank r, as
partition.py lays them out): E the embedding, t a decoder layer, m a multi-token
prediction module, L the output layer and the loss. "x*n" repeats a symbol, "(...)*n" a
group; commas are cosmetic. Megatron's rules: the stages are a multiple of
pipeline_model_parallel_size (their quotient is the virtual stages per rank), E comes
first and L last, each once, the decoder layers number num_layers, the m's
mtp_num_layers, after every decoder layer.

A stage may hold no decoder layer (DeepSeek-V3's "...|mL": the multi-token prediction
modules and the loss alone; "E|..." the embedding alone). mp runs the multi-token
prediction modules on the last stage, beside the loss: Megatron's standalone MTP stages
are refused, naming the stage.

Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split give segments too (`accounted_segments`): the
embedding and the loss each count as one layer of an even split, and the first (last)
virtual stage holds one decoder layer fewer.
"""

from __future__ import annotations

import re

__all__ = ["accounted_segments", "layout_segments", "parse_layout"]

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SYMBOL = re.compile(r"(.)\*(\d+)")
_SYMBOLS = "ELtm"


def parse_layout(layout: str) -> list[str]:
    """The stages of `layout`, each a string of E, t, m and L (repetitions unrolled);
    a ValueError names a symbol mp does not know."""
    text = layout.replace(",", "").replace(" ", "")
    text = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _SYMBOL.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for k, stage in enumerate(stages):
        for symbol in stage:
            if symbol not in _SYMBOLS:
                raise ValueError(
                    f"pipeline layout {layout!r}: stage {k} ({stage!r}) has {symbol!r}; the "
                    "symbols are E (embedding), t (decoder layer), m (multi-token "
                    "prediction), L (loss), '|' between stages, x*n and (...)*n"
                )
    return stages


def layout_segments(layout: str, num_layers: int, mtp_num_layers: int | None,
                    pipeline_model_parallel_size: int) -> list[int]:  # fmt: skip
    """The decoder layers of each virtual stage (partition.stage_layers' `segments`) after
    Megatron's checks and mp's (module docstring); a ValueError names what is wrong."""
    stages = parse_layout(layout)
    pp = pipeline_model_parallel_size
    where = f"pipeline layout {layout!r}"
    if len(stages) % pp:
        raise ValueError(f"{where} has {len(stages)} stages: not a multiple of "
                         f"pipeline_model_parallel_size={pp}")  # fmt: skip
    flat = "".join(stages)
    if flat.count("E") != 1 or not flat.startswith("E"):
        raise ValueError(f"{where}: E (the embedding) must come first, once")
    if flat.count("L") != 1 or not flat.endswith("L"):
        raise ValueError(f"{where}: L (the loss) must come last, once")
    if flat.count("t") != num_layers:
        raise ValueError(f"{where} holds {flat.count('t')} decoder layers (t), "
                         f"num_layers={num_layers}")  # fmt: skip
    mtp = mtp_num_layers or 0
    if flat.count("m") != mtp:
        raise ValueError(f"{where} holds {flat.count('m')} multi-token prediction modules "
                         f"(m), mtp_num_layers={mtp_num_layers}")  # fmt: skip
    if "m" in flat and "t" in flat[flat.index("m") :]:
        raise ValueError(f"{where}: the multi-token prediction modules (m) come after every "
                         "decoder layer")  # fmt: skip
    for k, stage in enumerate(stages):
        if "m" in stage and k != len(stages) - 1:
            raise ValueError(
                f"{where}: stage {k} ({stage!r}) holds multi-token prediction modules; mp "
                "runs them on the last stage, beside the loss (Megatron's standalone MTP "
                "stages are not supported)"
            )
    return [stage.count("t") for stage in stages]


def accounted_segments(num_layers: int, pp: int, vpp: int | None, embedding: bool,
                       loss: bool) -> list[int]:  # fmt: skip
    """The decoder layers of each virtual stage, in virtual-stage order, when the embedding
    and/or the loss count as a layer each (Megatron-LM's rule): the layers plus those
    split evenly over pp x vpp virtual stages, the first stage holding one fewer for the
    embedding, the last one fewer for the loss. A ValueError when they do not divide."""
    counted = num_layers + int(embedding) + int(loss)
    what = " + ".join(["num_layers", *["the embedding"] * embedding, *["the loss"] * loss])
    if counted % pp:
        raise ValueError(f"{what} = {counted} layers are not divisible by "
                         f"pipeline_model_parallel_size={pp}")  # fmt: skip
    per_rank = counted // pp
    if per_rank % (vpp or 1):
        raise ValueError(f"{what} = {counted} layers, {per_rank} per pipeline stage, are not "
                         f"divisible by virtual_pipeline_model_parallel_size={vpp}")  # fmt: skip
    per_stage = per_rank // (vpp or 1)
    segments = [per_stage] * (pp * (vpp or 1))
    segments[0] -= int(embedding)
    segments[-1] -= int(loss)
    return segments
