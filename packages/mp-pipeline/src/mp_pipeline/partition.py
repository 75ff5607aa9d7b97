"""Which transformer layers each pipeline stage (and virtual stage) holds.

num_layers are split over pp ranks, evenly or with given counts on the first
and last stage (the rest evenly over the middle ones). With v virtual stages
each rank's layers are split evenly into v chunks, and the chunks are laid
out in virtual-stage order: chunk c of rank r is virtual stage c * pp + r, so
it follows chunk c of rank r - 1 and, on rank 0, chunk c - 1 of the last rank.
The embedding belongs to virtual stage 0, the output layer and loss to the
last virtual stage. `segments` gives each virtual stage's layers instead (Megatron's
"|"-separated hybrid pattern, or its pipeline layout string, layout.py): virtual stage
c * pp + r holds segments[c * pp + r], which may be none (the embedding, or the loss,
alone on a stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StageLayers", "stage_layers"]


@dataclass(frozen=True)
class StageLayers:
    """The layers of one (virtual) stage: offset .. offset + count - 1."""

    offset: int
    count: int
    pre_process: bool
    """Holds the embedding (the first virtual stage)."""

    post_process: bool
    """Holds the output layer and the loss (the last virtual stage)."""


def stage_layers(
    num_layers: int,
    pipeline_model_parallel_size: int,
    pipeline_rank: int,
    *,
    virtual_pipeline_model_parallel_size: int | None = None,
    vp_stage: int = 0,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    segments: Sequence[int] | None = None,
) -> StageLayers:
    """The layers of model chunk `vp_stage` on pipeline rank `pipeline_rank`; segments:
    the layers of every virtual stage, in virtual-stage order (module docstring)."""
    pp, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if not 0 <= pipeline_rank < pp:
        raise ValueError(f"pipeline_rank={pipeline_rank} must be in 0 .. {pp - 1}")
    if not 0 <= vp_stage < v:
        raise ValueError(f"vp_stage={vp_stage} must be in 0 .. {v - 1}")
    if segments is not None:
        first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
        return _segment(num_layers, pp, v, pipeline_rank, vp_stage, list(segments), first,
                        last)  # fmt: skip
    counts = _layers_per_rank(num_layers, pp, num_layers_in_first_pipeline_stage,
                              num_layers_in_last_pipeline_stage)  # fmt: skip
    for rank, count in enumerate(counts):
        if count % v:
            raise ValueError(
                f"pipeline stage {rank} holds {count} layers, not divisible by "
                f"virtual_pipeline_model_parallel_size={v}"
            )
    sizes = [count // v for count in counts]
    offset = vp_stage * sum(sizes) + sum(sizes[:pipeline_rank])
    return StageLayers(
        offset=offset,
        count=sizes[pipeline_rank],
        pre_process=pipeline_rank == 0 and vp_stage == 0,
        post_process=pipeline_rank == pp - 1 and vp_stage == v - 1,
    )


def _segment(num_layers: int, pp: int, v: int, rank: int, vp_stage: int, segments: list[int],
             first: int | None, last: int | None) -> StageLayers:  # fmt: skip
    if first is not None or last is not None:
        raise ValueError(
            f"segments={segments} give every stage's layers: num_layers_in_first_pipeline_stage="
            f"{first} and num_layers_in_last_pipeline_stage={last} must be None"
        )
    if len(segments) != pp * v:
        raise ValueError(
            f"{len(segments)} segments for pipeline_model_parallel_size={pp} x "
            f"virtual_pipeline_model_parallel_size={v}: one per virtual stage"
        )
    if sum(segments) != num_layers or min(segments) < 0:
        raise ValueError(f"segments={segments} must hold num_layers={num_layers} layers in "
                         "all, none below zero")  # fmt: skip
    index = vp_stage * pp + rank
    return StageLayers(
        offset=sum(segments[:index]), count=segments[index],
        pre_process=index == 0, post_process=index == pp * v - 1,
    )  # fmt: skip


def _layers_per_rank(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    if num_layers < 1 or pp < 1:
        raise ValueError(
            f"num_layers={num_layers} and pipeline_model_parallel_size={pp} must be >= 1"
        )
    ends = {0: first, pp - 1: last} if pp > 1 else {}
    fixed = {rank: n for rank, n in ends.items() if n is not None}
    for rank, n in fixed.items():
        name = "first" if rank == 0 else "last"
        if n < 0:
            raise ValueError(f"num_layers_in_{name}_pipeline_stage={n} must be >= 0")
    free = [rank for rank in range(pp) if rank not in fixed]
    rest = num_layers - sum(fixed.values())
    if rest < 0 or (free and rest % len(free)) or (not free and rest):
        raise ValueError(
            f"num_layers={num_layers} cannot be split over pipeline_model_parallel_size={pp} "
            f"with first stage {first} and last stage {last}: the other {len(free)} stages "
            f"would share {rest} layers unevenly"
        )
    each = rest // len(free) if free else 0
    return [fixed.get(rank, each) for rank in range(pp)]
