"""Seeds and random-number streams, with Megatron's rules.

Seeds. Every rank seeds python, numpy (when installed) and torch with

    seed + 100 * pipeline_rank  [+ 10 * data_parallel_rank with data_parallel_random_init]

so pipeline stages initialize different layers differently, while
tensor-parallel ranks of one stage draw the same numbers (replicated weights
and the same data order).

Streams. Some random numbers must differ between tensor-parallel ranks
(dropout on a TP-sharded activation, initialization of a sharded weight),
others must agree. The tracker keeps named generator states beside the
default one, and `fork(name)` swaps a named state in for the duration of a
block, so that `torch.nn.functional.dropout` (which only reads the default
generator) draws from it:

    model-parallel-rng   seed + 2718 + tp_rank                   differs per TP rank
    data-parallel-rng    seed                                    same on every TP rank
    expert-parallel-rng  seed + 1024 + 100 * ep_rank + etp_rank  differs per expert shard

(`seed` here is the per-stage seed above.) The tracker works on the CPU
generator or on one CUDA device's, and its states can be saved and restored,
so a resumed run draws the same numbers as an uninterrupted one.
`rng_state_kept()` undoes whatever a block draws, for work (such as starting
a DataLoader, which takes its base seed from the default generator) that must
not move the training's streams.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from mp_state.devices import device_type

if TYPE_CHECKING:
    from mp_state.parallel_state import ParallelState

try:  # numpy is optional here: seeded when installed, for code that draws from it
    import numpy
except ImportError:
    numpy = None

__all__ = [
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "TENSOR_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_state",
    "model_parallel_seeds",
    "rng_state_kept",
    "set_random_seeds",
    "set_rng_state",
    "stage_seed",
]

TENSOR_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class RNGStatesTracker:
    """Named generator states for one device, swapped in with `fork(name)`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[int, str] = {}
        self._forked: set[str] = set()

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Adds a stream seeded with `seed`, leaving the default generator untouched."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} for {name!r} is already used by {self._seeds[seed]!r}")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        self._seeds[seed] = name

    def reset(self) -> None:
        """Forgets every stream."""
        if self._forked:
            raise RuntimeError(f"cannot reset while fork({sorted(self._forked)}) is active")
        self._states.clear()
        self._seeds.clear()

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG) -> Iterator[None]:
        """Draws from stream `name` inside the block; the default stream resumes after it.

        Forks of different streams nest. Forking a stream that is already
        forked is an error: the inner block would replay the outer one's numbers.
        """
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added; known: {self.names}")
        if name in self._forked:
            raise RuntimeError(f"fork({name!r}) is already active: it cannot be nested in itself")
        outer = _get_device_state(self.device)
        _set_device_state(self.device, self._states[name])
        self._forked.add(name)
        try:
            yield
        finally:
            self._states[name] = _get_device_state(self.device)
            _set_device_state(self.device, outer)
            self._forked.discard(name)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and activation recompute)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restores states from `get_states`; streams not named keep theirs."""
        unknown = sorted(set(states) - set(self._states))
        if unknown:
            raise KeyError(f"RNG states {unknown} were never added; known: {self.names}")
        for name, state in states.items():
            self._states[name] = state.clone()


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def stage_seed(seed: int, pp_rank: int, dp_rank: int = 0, data_parallel_random_init=False) -> int:
    """Megatron's per-rank seed: seed + 100 * pp_rank (+ 10 * dp_rank)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed <= 0:
        raise ValueError(f"seed={seed!r} must be a positive integer")
    return seed + 100 * pp_rank + (10 * dp_rank if data_parallel_random_init else 0)


def model_parallel_seeds(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> dict[str, int]:
    """The tracker's stream seeds for one rank, from its per-stage seed."""
    return {
        DATA_PARALLEL_RNG: seed,
        TENSOR_PARALLEL_RNG: seed + 2718 + tp_rank,
        EXPERT_PARALLEL_RNG: seed + 1024 + 100 * ep_rank + etp_rank,
    }


def set_random_seeds(
    seed: int,
    state: ParallelState,
    *,
    data_parallel_random_init: bool = False,
    device: torch.device | str | None = None,
) -> RNGStatesTracker:
    """Seeds python, numpy and torch for this rank and returns its stream tracker.

    `device` is the generator the tracker drives: by default the current CUDA
    device when this process computes on CUDA (mp_state.device_type()), else the CPU.
    """
    s = stage_seed(seed, state.pp.rank, state.dp.rank, data_parallel_random_init)
    random.seed(s)
    if numpy is not None:
        numpy.random.seed(s)
    torch.manual_seed(s)  # the CPU and every CUDA device
    if device is None:
        device = device_type()
    tracker = RNGStatesTracker(device)
    for name, stream_seed in model_parallel_seeds(
        s, state.tp.rank, state.ep.rank, state.expert_tp.rank
    ).items():
        tracker.add(name, stream_seed)
    return tracker


def get_rng_state(tracker: RNGStatesTracker | None = None) -> dict[str, Any]:
    """Every generator this rank draws from, for a checkpoint."""
    saved: dict[str, Any] = {
        "random": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "tracker": tracker.get_states() if tracker is not None else None,
    }
    saved["numpy"] = numpy.random.get_state() if numpy is not None else None
    return saved


def set_rng_state(saved: dict[str, Any], tracker: RNGStatesTracker | None = None) -> None:
    """Restores what `get_rng_state` captured."""
    random.setstate(saved["random"])
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None:
        torch.cuda.set_rng_state_all(saved["cuda"])
    if saved["numpy"] is not None and numpy is not None:
        numpy.random.set_state(saved["numpy"])
    if tracker is not None and saved["tracker"] is not None:
        tracker.set_states(saved["tracker"])


@contextmanager
def rng_state_kept(tracker: RNGStatesTracker | None = None) -> Iterator[None]:
    """Every generator `get_rng_state` captures is back at its state of entry when the
    block ends, whatever the block drew."""
    saved = get_rng_state(tracker)
    try:
        yield
    finally:
        set_rng_state(saved, tracker)
