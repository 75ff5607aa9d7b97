"""Output-discarding recompute (Megatron-LM's selective "layernorm", "moe_act" and
"mla_up_proj"): a function's output is freed once the modules after it have saved it, and
rebuilt in the same memory when backward reaches them.

    kept = OutputRecompute(active)
    normed = kept.run(norm, x)          # no graph inside; keeps x for the rerun
    out, bias = attention(normed)       # saves normed (its linear layers' input)
    kept.discard(out)                   # normed's memory is freed; the gradient arriving
                                        # at `out` reruns norm(x) into that memory

torch.utils.checkpoint keeps a function's inputs and recomputes its inner tensors, but not
its output, which the next modules saved for their own backward. Here the output's
storage is resized to nothing after those modules ran: every saved reference to it (views
included) keeps its tensor, now without bytes. A hook on `after` (the consumers' output,
whose gradient arrives before theirs is computed) runs the function again and copies the
result into the same storage (through the storage, which leaves the tensors' version
counters alone: autograd checks them when it unpacks a saved tensor), then the function's
backward runs from the rerun's graph.

Saved: the output and every tensor the function keeps for backward; the cost: running it
once more. The function must be deterministic and draw no random numbers (norms,
activations, projections). Memory is saved only where the consumers keep the output itself
or views of it: a module that saves a copy (a cast to another dtype, FP8's scaled
inputs) keeps its copy. An output sharing an input's storage is never freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from mp_layers.transformer.eager import eager_when_compiled
from mp_layers.transformer.recompute import inside_checkpoint

__all__ = ["OutputRecompute"]

_SAVED = object()
"""In _Run's list of arguments: the place of a saved tensor."""


class OutputRecompute:
    """One call of a function whose output is discarded and recomputed (module docstring):
    run() then discard(), which must follow. Inactive (`active` False, no gradient being
    recorded, or inside a checkpointed function: recompute.checkpointed keeps its inputs
    only already), run() calls the function and discard() does nothing."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._function: Callable | None = None
        self._ctx = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._rerun_inputs: list | None = None
        self._rerun_outputs: tuple[torch.Tensor, ...] | None = None

    def run(self, function: Callable, *args):
        """function(*args): a tensor or a tuple of tensors; tensor arguments are kept."""
        if not self.active:  # (inside a compiled layer: traced as a plain call)
            return function(*args)
        return self._run(function, *args)

    def discard(self, after: torch.Tensor) -> None:
        """Frees the output's memory; the gradient reaching `after` (computed from the
        output by the modules that saved it) rebuilds it first."""
        if self.active:
            self._discard(after)

    # Inside a compiled layer these run eagerly (a graph break at each, where active): the
    # storage is resized and the hook registered outside the traced graphs.
    @eager_when_compiled
    def _run(self, function: Callable, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.active = (
            torch.is_grad_enabled()
            and not inside_checkpoint()
            # else no gradient could reach the function's parameters through _Run (which
            # returns a graph only through a tensor input that requires one)
            and any(t.requires_grad for t in tensors)
        )
        if not self.active:  # no backward, or a checkpoint around keeps nothing of it
            return function(*args)
        self._function = function
        outputs = _Run.apply(self, *args)
        self._outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return outputs

    @eager_when_compiled
    def _discard(self, after: torch.Tensor) -> None:
        inputs = {t.untyped_storage().data_ptr() for t in self._ctx.saved_tensors
                  if t is not None}  # fmt: skip
        for output in self._outputs:
            storage = output.untyped_storage()
            if storage.data_ptr() not in inputs:
                storage.resize_(0)
        after.register_hook(self._rerun)

    def _rerun(self, _grad: torch.Tensor) -> None:
        if self._ctx is None or self._rerun_outputs is not None:
            return
        inputs = [
            t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in _arguments(self._ctx)
        ]
        with torch.enable_grad():
            outputs = self._function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        for kept, new in zip(self._outputs, outputs, strict=True):
            storage, rebuilt = kept.untyped_storage(), new.untyped_storage()
            if storage.nbytes() == 0 and rebuilt.nbytes():
                storage.resize_(rebuilt.nbytes())
                storage.copy_(rebuilt)
        self._rerun_inputs, self._rerun_outputs = inputs, outputs

    def _backward(self, grads: tuple) -> tuple:
        """The gradients of the function's arguments, from the rerun's graph."""
        if self._rerun_outputs is None:  # `after` got no gradient: nothing was discarded-read
            self._rerun(None)
        inputs, outputs = self._rerun_inputs, self._rerun_outputs
        self._rerun_inputs = self._rerun_outputs = self._ctx = self._function = None
        self._outputs = ()
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True)
                 if g is not None and o.requires_grad]  # fmt: skip
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return tuple(
            t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs
        )


class _Run(torch.autograd.Function):
    """recompute's function(*args) without a graph; backward: OutputRecompute._backward."""

    @staticmethod
    def forward(ctx, recompute: OutputRecompute, *args):
        with torch.no_grad():
            outputs = recompute._function(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.others = [_SAVED if isinstance(a, torch.Tensor) else a for a in args]
        # Weakly: the hook discard() puts in the graph holds it until backward (and the
        # graph's node does not hold it back: no reference cycle through autograd).
        ctx.recompute = weakref.ref(recompute)
        recompute._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.recompute()._backward(grads))


def _arguments(ctx) -> list:
    """_Run's arguments again: the saved tensors in their places among the others."""
    tensors = iter(ctx.saved_tensors)
    return [next(tensors) if a is _SAVED else a for a in ctx.others]
