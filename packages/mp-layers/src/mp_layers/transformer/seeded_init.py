"""Initialization that does not depend on the pipeline layout.

Weights are drawn from the default generator while modules are built. A
stage holding layers 4..7 would draw them from another point of the stream
than a model holding 0..7, so the same seed would give another model. With
an init seed, each part (the embedding, layer i by its global index, the
output layer) is drawn from a generator seeded by the init seed and the
part's name alone: every TP / PP / VPP layout builds the same global model
(TP independence comes from drawing each full weight, tensor_parallel/
initialization.py). The generators' states are restored afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

import mp_state

__all__ = ["seeded_init"]


@contextlib.contextmanager
def seeded_init(init_seed: int | None, part: str) -> Iterator[None]:
    """Builds the part under a seed of its own (nothing changes when init_seed is None)."""
    if init_seed is None:
        yield
        return
    digest = hashlib.sha256(f"{init_seed}:{part}".encode()).digest()
    # The CUDA generator is kept only where this process computes on CUDA: a CPU rank
    # (MP_DEVICE=cpu on a GPU machine) must not initialize CUDA.
    devices = [torch.cuda.current_device()] if mp_state.device_type() == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        yield
