"""What the training step and the evaluation share: the run's pipeline schedule
(mp-pipeline's: no pipelining, 1F1B, or interleaved with virtual stages) and Megatron's
points for emptying the CUDA cache (empty_unused_memory_level)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mp_pipeline import get_forward_backward_func
from mp_train.loop.setup import Run

__all__ = ["empty_unused_memory", "schedule_of"]


def schedule_of(run: Run) -> Callable:
    """The forward-backward function of the run's pipeline layout."""
    vpp = run.config.parallel.virtual_pipeline_model_parallel_size
    return get_forward_backward_func(run.state.pp.size, vpp)


def empty_unused_memory(run: Run, level: int) -> None:
    """torch.cuda.empty_cache() where empty_unused_memory_level asks for it at `level`
    (Megatron's points: 1 after forward-backward and each evaluation step, 2 after the
    optimizer step too); nothing on a CPU."""
    if run.config.training.empty_unused_memory_level >= level and run.device.type == "cuda":
        torch.cuda.empty_cache()
