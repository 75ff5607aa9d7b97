"""Pipeline segments: a hybrid model's (Megatron's "|" in --hybrid-layer-pattern), or
Megatron's --pipeline-model-parallel-layout (mp_pipeline.layout) or
--account-for-embedding/loss-in-pipeline-split (mp_pipeline.accounted_segments) for any
model.

"M*M|*M*|M*|-E" splits the decoder's layers into segments, one per virtual pipeline stage
in virtual-stage order (mp_pipeline.stage_layers' `segments`): their number must be a
multiple of pipeline_model_parallel_size, and virtual_pipeline_model_parallel_size is
their number / pipeline_model_parallel_size when that is above 1 (Megatron-LM's rules).
The flags that would also split the layers (--decoder-first-pipeline-num-layers,
--decoder-last-pipeline-num-layers, --virtual-pipeline-model-parallel-size other than the
segments') are refused beside them. At pipeline_model_parallel_size 1 the one stage holds
every segment, so that a checkpoint trained with segments loads and generates on one
rank. The layout string gives the same segments (its stages' decoder layers), under the
same rules; beside a hybrid pattern it is refused, as in Megatron-LM (the pattern's "|"
place the stages there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mp_layers import hybrid_pipeline_segments
from mp_pipeline import accounted_segments, layout_segments, parse_layout

if TYPE_CHECKING:
    from mp_train.configuration.config import RunConfig

__all__ = ["check_segments", "derive_virtual_stages", "pipeline_segments"]


def pipeline_segments(config: RunConfig) -> list[int] | None:
    """The layers of each virtual pipeline stage the pattern gives, None where the layers
    are split evenly (no "|", or one pipeline stage)."""
    parallel, model = config.parallel, config.model
    if parallel.pipeline_model_parallel_layout is not None:
        pp = parallel.pipeline_model_parallel_size
        segments = layout_segments(parallel.pipeline_model_parallel_layout, model.num_layers,
                                   model.mtp_num_layers, pp)  # fmt: skip
        return segments if pp > 1 else None
    if parallel.pipeline_model_parallel_size == 1:
        return None
    embedding = parallel.account_for_embedding_in_pipeline_split
    loss = parallel.account_for_loss_in_pipeline_split
    if embedding or loss:
        return accounted_segments(model.num_layers, parallel.pipeline_model_parallel_size,
                                  parallel.virtual_pipeline_model_parallel_size, embedding,
                                  loss)  # fmt: skip
    return hybrid_pipeline_segments(model)


def check_segments(config: RunConfig) -> bool:
    """Whether the pattern's segments place the layers (pipeline_segments); raises a
    ValueError unless there is one per virtual stage (a RunConfig not made by the parser,
    whose derive_virtual_stages sees to it)."""
    segments = pipeline_segments(config)
    if segments is None:
        return False
    pp = config.parallel.pipeline_model_parallel_size
    vpp = config.parallel.virtual_pipeline_model_parallel_size or 1
    if len(segments) != pp * vpp:
        raise ValueError(
            f"hybrid_layer_pattern={config.model.hybrid_layer_pattern!r} has {len(segments)} "
            f"pipeline segments, not one per virtual stage: pipeline_model_parallel_size={pp} "
            f"x virtual_pipeline_model_parallel_size={vpp}"
        )
    return True


def derive_virtual_stages(values: dict[str, dict[str, Any]]) -> None:
    """Sets virtual_pipeline_model_parallel_size from the pattern's or the layout's
    segments (module docstring); raises a ValueError naming the flags that disagree with
    them."""
    pattern = values["model"].get("hybrid_layer_pattern")
    parallel = values["parallel"]
    layout = parallel.get("pipeline_model_parallel_layout")
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if parallel.get(name) and pattern is not None:
            raise ValueError(f"--{name.replace('_', '-')} beside --hybrid-layer-pattern: a "
                             "hybrid model's stages are placed by the pattern's '|'; drop "
                             "the flag")  # fmt: skip
    if layout is not None:
        if pattern is not None:
            raise ValueError("--pipeline-model-parallel-layout beside --hybrid-layer-pattern: "
                             "the pattern's '|' place a hybrid model's stages (Megatron-LM "
                             "refuses the pair too); give one")  # fmt: skip
        count = len(parse_layout(layout))
        given = f"--pipeline-model-parallel-layout {layout!r} has {count} stages"
        model = values["model"]
        if model.get("num_layers") is not None:  # what the layout places, checked early
            pp = parallel.get("pipeline_model_parallel_size") or 1
            layout_segments(layout, model["num_layers"], model.get("mtp_num_layers"), pp)
    elif isinstance(pattern, str) and "|" in pattern.split("/")[0]:
        count = pattern.split("/")[0].count("|") + 1
        given = f"--hybrid-layer-pattern {pattern!r} has {count} pipeline segments"

    else:
        return
    pp = parallel.get("pipeline_model_parallel_size") or 1
    if pp == 1:
        return
    if count % pp:
        raise ValueError(f"{given}: not a multiple of --pipeline-model-parallel-size {pp}")
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if parallel.get(name) is not None:
            raise ValueError(f"{given}, which give every stage's layers: drop "
                             f"--{name.replace('_', '-')}")  # fmt: skip
    virtual = count // pp if count > pp else None
    vpp = parallel.get("virtual_pipeline_model_parallel_size")
    if vpp is not None and vpp != virtual:
        raise ValueError(
            f"{given} at --pipeline-model-parallel-size {pp}: virtual pipeline stages "
            f"{virtual or 1} per rank, not --virtual-pipeline-model-parallel-size {vpp} (the "
            "segments give them; drop the flag)"
        )
    parallel["virtual_pipeline_model_parallel_size"] = virtual
