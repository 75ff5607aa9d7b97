"""Megatron-LM's --deterministic-mode for a run's process: bit-exact repeatable execution.

    apply_deterministic_mode()   before the process group and the first CUDA kernel

It checks the environment variables that decide whether NCCL and cuBLAS reduce in a fixed
order, sets the missing ones to Megatron's values (NCCL_ALGO=Ring,
CUBLAS_WORKSPACE_CONFIG=:4096:8, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0), and turns on
torch.use_deterministic_algorithms, under which an operation without a deterministic
implementation raises, naming itself, instead of running. NCCL reads its variables when its
communicator forms and cuBLAS when its handle does: the call comes before either.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

__all__ = ["DETERMINISTIC_ENV", "apply_deterministic_mode"]

DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                     "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}  # fmt: skip
"""Megatron's values, set where the environment has none."""

_NCCL_ALGOS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
"""The NCCL algorithms Megatron-LM accepts as deterministic (not Tree)."""
_ACCEPTED = {"CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8"),
             "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",)}  # fmt: skip


def apply_deterministic_mode(env: MutableMapping[str, str] | None = None) -> None:
    """Checks and completes the environment (os.environ by default; module docstring) and
    makes torch's algorithms deterministic. A value that would break repeatability raises a
    ValueError naming the variable."""
    env = os.environ if env is None else env
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in _NCCL_ALGOS for t in tokens):
            raise ValueError(f"--deterministic-mode with NCCL_ALGO={algo!r}: each algorithm "
                             f"must be one of {', '.join(sorted(_NCCL_ALGOS))} (Tree's "
                             "reduction order is not fixed)")  # fmt: skip
    for name, accepted in _ACCEPTED.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            raise ValueError(f"--deterministic-mode with {name}={value!r}: deterministic "
                             f"values are {', '.join(accepted)}")  # fmt: skip
    for name, value in DETERMINISTIC_ENV.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
