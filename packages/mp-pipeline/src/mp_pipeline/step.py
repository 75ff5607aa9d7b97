"""One rank's forward and backward steps, shared by every schedule.

The forward-step function is Megatron's:

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(...)            # the model reads its stage input from set_input_tensor
        return output, partial(loss_func, batch)

    loss_func(output) -> (loss, report)               # loss averaged over the micro-batch
                      or (loss, num_tokens, report)   # per-token normalization

On the last stage the loss is divided by the number of micro-batches, a
(loss, num_tokens) sum first by its token count (at least 1, as in Megatron-LM:
a micro-batch without loss tokens adds nothing); with calculate_per_token_loss
it is left a sum for finalize to divide by the global batch's tokens. The
report is collected. Before a stage's forward
its input tensor (received from the previous stage, None on the first) is
handed to the model with `set_input_tensor`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mp_pipeline.config import PipelineConfig

__all__ = ["StepRunner", "set_input_tensor"]

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable]]


def set_input_tensor(model: torch.nn.Module, tensor: torch.Tensor | None) -> None:
    """Hands the stage input to a model chunk (through wrappers with a .module)."""
    target = model
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module
    if not hasattr(target, "set_input_tensor"):
        raise TypeError(
            f"{type(model).__name__} has no set_input_tensor(tensor): a pipeline stage "
            "must take its input from the previous stage that way"
        )
    target.set_input_tensor(tensor)


class StepRunner:
    """Forward and backward of micro-batches on this rank; collects the losses."""

    def __init__(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterators: list[Iterator | None],
        model_chunks: list[torch.nn.Module],
        num_microbatches: int,
        config: PipelineConfig,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.data_iterators = data_iterators
        self.model_chunks = model_chunks
        self.num_microbatches = num_microbatches
        self.config = config
        self.losses: list[Any] = []
        # Tokens counted by the last stage's loss functions (zero elsewhere); handed
        # to finalize on every rank when the loss is normalized per token.
        self.num_tokens = torch.zeros((), dtype=torch.int64)
        # One stack per no_sync context (per model chunk when no_sync_func is a list).
        self._no_sync: list[contextlib.ExitStack] | None = None

    def forward(self, chunk: int, input_tensor: torch.Tensor | None, last_stage: bool):
        model = self.model_chunks[chunk]
        set_input_tensor(model, input_tensor)
        output, loss_func = self.forward_step_func(self.data_iterators[chunk], model)
        if not last_stage:
            return output
        result = loss_func(output)
        if len(result) == 3:
            loss, tokens, report = result
            tokens = torch.as_tensor(tokens).detach()
            self.num_tokens = self.num_tokens + tokens.to(torch.int64)
            if not self.config.calculate_per_token_loss:
                # A micro-batch without loss tokens (an SFT sample cut before its answer)
                # adds 0 to the loss, not 0 / 0: the count is at least 1 (Megatron-LM's).
                loss = loss / tokens.clamp(min=1) / self.num_microbatches
        elif len(result) == 2:
            loss, report = result
            loss = loss / self.num_microbatches
        else:
            raise ValueError(
                f"loss_func returned {len(result)} values: expected (loss, report) or "
                "(loss, num_tokens, report)"
            )
        self.losses.append(report)
        return loss

    def backward(
        self,
        input_tensor: torch.Tensor | None,
        output: torch.Tensor,
        output_grad: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Backward of one micro-batch; returns the gradient of its stage input."""
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_grad is None and self.config.grad_scale_func is not None:
            output = self.config.grad_scale_func(output)
        if output_grad is not None and output.numel() != output_grad.numel():
            # The output's data was freed after sending (deallocate_output): run the
            # backward through its autograd node without autograd's shape check.
            torch.autograd.Variable._execution_engine.run_backward(
                (output,), (output_grad,), False, False, (), True, True
            )
        else:
            torch.autograd.backward(output, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None

    def deallocate(self, output: torch.Tensor | None) -> None:
        """Frees a sent output's data; its autograd node (all backward needs) stays."""
        if not self.config.deallocate_pipeline_outputs or output is None:
            return
        if output._base is not None or not output.requires_grad:
            return  # a view shares its data; a tensor without a graph is not kept anyway
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)

    def disable_grad_sync(self) -> None:
        """Enters no_sync (of every chunk) for all but the last backward."""
        funcs = self.config.no_sync_func
        if funcs is None or self._no_sync is not None:
            return
        self._no_sync = []
        for func in funcs if isinstance(funcs, list) else [funcs]:
            stack = contextlib.ExitStack()
            stack.enter_context(func())
            self._no_sync.append(stack)

    def enable_grad_sync(self, chunk: int | None = None) -> None:
        """Leaves no_sync: of every chunk; or, given `chunk`, of that model chunk alone
        when no_sync_func has one context per chunk, and else nothing (a context shared by
        the chunks is left before the last backward of all). The interleaved schedule
        leaves each chunk's before that chunk's last backward: a FSDP2 chunk reduces its
        gradients in a backward run outside no_sync, and never later."""
        if self._no_sync is None:
            return
        if chunk is not None:
            if len(self._no_sync) == len(self.model_chunks):
                self._no_sync[chunk].close()
            return
        for stack in self._no_sync:
            stack.close()
        self._no_sync = None

    def finalize(self) -> None:
        self.enable_grad_sync()
        if self.config.finalize_model_grads_func is not None:
            per_token = self.config.calculate_per_token_loss
            self.config.finalize_model_grads_func(
                self.model_chunks, self.num_tokens if per_token else None
            )
