"""Activation recompute that reproduces every random draw.

torch.utils.checkpoint stores only a function's inputs and runs it again
during backward; it restores the default CPU and CUDA generators for the
rerun. Dropout on tensor-parallel activations draws from the tracker's named
streams instead, which the first run has advanced. So the tracker's states
are captured when the function first runs and put back for the rerun (and
the advanced states restored after it), so the rerun draws the same masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from mp_layers.transformer.eager import eager_when_compiled
from mp_state import RNGStatesTracker

__all__ = ["checkpointed", "inside_checkpoint", "recomputing"]

_reruns = 0
_inside = 0


def inside_checkpoint() -> bool:
    """Whether a checkpointed function is running (its first run or its rerun): what it
    calls keeps nothing for backward but through the checkpoint, so an output-discarding
    recompute inside it (output_recompute.py) stands aside."""
    return _inside > 0


def recomputing() -> bool:
    """Whether a recomputation for backward is running: the forward of the layers runs a
    second time, which must not count what the first run counted (a router's statistics)."""
    return _reruns > 0


# Inside a compiled layer (selective recompute, a MoE layer's MLP) the checkpoint runs
# eagerly: Dynamo traces torch.utils.checkpoint only with the context_fn of
# selective-checkpoint policies, not the RNG-restoring one above.
@eager_when_compiled
def checkpointed(function: Callable, rng_tracker: RNGStatesTracker | None, *args):
    """function(*args), keeping only the inputs for backward and recomputing the rest."""
    snapshot: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def first_run() -> Iterator[None]:
        global _inside
        if rng_tracker is not None:
            snapshot.update(rng_tracker.get_states())
        _inside += 1
        try:
            yield
        finally:
            _inside -= 1

    @contextlib.contextmanager
    def rerun() -> Iterator[None]:
        global _reruns, _inside
        _reruns += 1
        _inside += 1
        try:
            if rng_tracker is None:
                yield
                return
            advanced = rng_tracker.get_states()
            rng_tracker.set_states(snapshot)
            try:
                yield
            finally:
                rng_tracker.set_states(advanced)
        finally:
            _reruns -= 1
            _inside -= 1

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (first_run(), rerun()),
    )  # fmt: skip
