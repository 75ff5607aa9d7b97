"""Regional compilation: each transformer layer compiled in place with torch.compile.

    count = compile_layers(model)    # before the first forward; returns the layers compiled

Each TransformerLayer (and a hybrid model's MambaLayer, whose scan traces whole) is
compiled where it sits (torch.nn.Module.compile): the module tree, parameter names and
state_dict keys stay as they were, so checkpoints, DDP's buffers and the sharding
descriptions do not change. The layers of a model share one
forward, so Dynamo traces it once and every layer of the same shape reuses the graph
(its parameters are graph inputs); a pipeline stage compiles its own layers.

What the compiled graph holds, and what stays eager (a graph break at each):

- tensor-parallel collectives (all-reduce, all-gather, reduce-scatter inside the
  mappings' autograd functions) are traced into the graph as functional collectives:
  TP and sequence parallelism compile without a graph break;
- context-parallel ring attention (p2p and all_gather; ring_attention.py) runs eagerly:
  its p2p exchanges and timed waits are not traceable; all-to-all (Ulysses) is traced;
- a mixture-of-experts MLP (moe_layer.py) runs eagerly: routing gives data-dependent
  token counts per expert (a recompile or a break every iteration); the layer's
  attention, norms and residuals are compiled around it;
- the attention over packed documents (core_attention's _attend_packed) runs eagerly:
  the documents' bounds are each batch's own, so compiled it recompiled at each new
  document length (until torch's recompile limit of 8 left it eager, with a warning);
- the blocked attention (blocked_attention.py, with its own backward) runs eagerly:
  it was faster so than compiled on the CPU measured (docs/training.md);
- activation recompute (recompute.checkpointed) runs eagerly around its function:
  selective recompute's core attention and a MoE layer's recomputed MLP; full
  recompute checkpoints the compiled layers from outside;
- dropout drawn from the tensor-parallel RNG stream (attention dropout, hidden dropout
  under sequence parallelism) runs eagerly where the stream is forked.

A layer sharded by FSDP2 (ZeRO-2/3) gathers its parameters and reduces its gradients in
FSDP2's hooks, which torch marks not to be traced: they run eagerly around the compiled
layer, without a graph break.

Options: shapes are static (dynamic=False: sequence and micro-batch are fixed in
training; another shape, such as evaluation in no-grad mode, compiles once more), and
random ops fall back to eager's kernels (inductor's fallback_random), so a dropout
mask is the one the eager layer draws from the same generator state, and compiled
and eager runs agree within rounding.
"""

from __future__ import annotations

import torch

from mp_layers.transformer.eager import arm_eager_functions
from mp_layers.transformer.layer import TransformerLayer
from mp_layers.transformer.mamba_layer import MambaLayer

__all__ = ["compile_layers"]


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compiles every TransformerLayer and MambaLayer inside `model` in place; returns how
    many. The compilation itself happens at each layer's first call. backend:
    torch.compile's (inductor, or e.g. "eager": Dynamo's graphs run as captured, for
    tests)."""
    arm_eager_functions()
    options = {"fallback_random": True} if backend == "inductor" else None
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer | MambaLayer)]
    for layer in layers:
        layer.compile(backend=backend, dynamic=False, options=options)
    return len(layers)
