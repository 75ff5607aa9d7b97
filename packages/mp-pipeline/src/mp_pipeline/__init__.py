"""mp-pipeline: pipeline-parallel communication and Megatron's schedules.

A schedule takes a forward-step function, this rank's model chunks, a data
iterator and the number of micro-batches; it knows nothing of the model.
"""

from mp_pipeline.config import PipelineConfig
from mp_pipeline.finalize import finalize_model_grads
from mp_pipeline.layout import accounted_segments, layout_segments, parse_layout
from mp_pipeline.p2p import Exchange, P2PCommunicator
from mp_pipeline.partition import StageLayers, stage_layers
from mp_pipeline.schedules import (
    check_microbatch_group,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    schedule_table,
)
from mp_pipeline.step import set_input_tensor

__all__ = [
    "Exchange",
    "P2PCommunicator",
    "PipelineConfig",
    "StageLayers",
    "accounted_segments",
    "check_microbatch_group",
    "finalize_model_grads",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "layout_segments",
    "parse_layout",
    "schedule_table",
    "set_input_tensor",
    "stage_layers",
]
