"""PipelineConfig: what the schedules need to know of the run.

Megatron keeps these on the model's config (ModelParallelConfig); here they are
one small dataclass the training loop fills, so that the schedules know
nothing of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

__all__ = ["PipelineConfig"]


@dataclass(kw_only=True)
class PipelineConfig:
    seq_length: int | None = None
    """Sequence length of a micro-batch (the boundary tensors' first dimension before
    sequence / context parallelism splits it)."""

    micro_batch_size: int | None = None
    """Samples per micro-batch."""

    hidden_size: int | None = None
    """Width of the boundary tensors (the residual stream)."""

    tensor_model_parallel_size: int = 1
    """With sequence_parallel, the boundary tensors hold s / tp positions."""

    context_parallel_size: int = 1
    """The boundary tensors hold s / cp positions."""

    sequence_parallel: bool = False
    """Boundary tensors are split along the sequence over the tensor-parallel ranks."""

    pipeline_dtype: torch.dtype = torch.float32
    """dtype of the boundary tensors (bf16 / fp16 runs set it to match the model)."""

    variable_seq_lengths: bool = False
    """Micro-batches may differ in shape: each tensor's shape is sent before it."""

    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Scales the last stage's loss before the backward (the optimizer's scale_loss)."""

    no_sync_func: Callable[[], AbstractContextManager] | list | None = None
    """A context (or one per model chunk) suspending gradient reduction: held for all
    but the last micro-batch's backward (DistributedDataParallel.no_sync)."""

    finalize_model_grads_func: Callable[..., None] | None = None
    """Called as f(model_chunks, num_tokens) after the last backward: data-parallel
    reduction, tied-embedding and sequence-parallel gradients (see finalize.py)."""

    deallocate_pipeline_outputs: bool = True
    """Free each sent output's data, keeping only its autograd node for the backward."""

    p2p_timeout_s: float = 600.0
    """How long a send or receive between stages may wait for its peer before raising
    (Megatron's --distributed-timeout-minutes default, 10 minutes): a stage that hangs
    or dies is an error on its neighbours, not a hang."""

    microbatch_group_size_per_vp_stage: int | None = None
    """The interleaved schedule's micro-batches per group run through one model chunk
    (Megatron's; None: pipeline size). Between the pipeline size and the micro-batches;
    the remainder of the micro-batches by it must be 0 or at least the pipeline size."""

    overlap_p2p_comm: bool = False
    """The interleaved schedule posts each exchange of its steady state after the step
    that computes what it sends, and waits for it only before the step that needs what
    it receives: the forward's activations travel while the backward computes, and the
    backward's gradients while the next forward computes (Megatron-LM's; its training
    default, off in its core config as here). The other schedules do not read it."""

    overlap_p2p_comm_warmup_flush: bool = False
    """With overlap_p2p_comm, the interleaved schedule's warm-up forwards and flush
    backwards overlap their exchanges too: a rank posts the receive of its next step
    before computing this one (the leading rank, the first in forward and the last in
    backward, with its send after), and waits for a send only once the next is posted.
    Without overlap_p2p_comm: refused, as in Megatron-LM."""

    calculate_per_token_loss: bool = False
    """The loss function returns (loss sum, tokens, report); gradients are divided by
    the tokens of the global batch in finalize instead of by the micro-batch count."""

    def __post_init__(self) -> None:
        if self.overlap_p2p_comm_warmup_flush and not self.overlap_p2p_comm:
            raise ValueError(
                "overlap_p2p_comm_warmup_flush overlaps the warm-up's and the flush's "
                "exchanges as overlap_p2p_comm does the steady state's: it needs "
                "overlap_p2p_comm=True (Megatron-LM refuses it alone too)"
            )

    def tensor_shape(self) -> tuple[int, int, int] | None:
        """[s / (tp if sequence parallel) / cp, micro-batch, hidden], or None when unset."""
        if None in (self.seq_length, self.micro_batch_size, self.hidden_size):
            return None
        s = self.seq_length // self.context_parallel_size
        if self.sequence_parallel:
            s //= self.tensor_model_parallel_size
        return (s, self.micro_batch_size, self.hidden_size)
