"""SIGTERM (or another exit_signal) handled by every rank together (Megatron's
DistributedSignalHandler).

A scheduler (SLURM, Kubernetes) may send SIGTERM to one rank or to all, at
any moment. The handler only records it; once per iteration the loop asks
`received()`, an all-reduce over every rank, so that all of them agree to
stop after the same iteration, save, and exit 0.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

__all__ = ["DistributedSignalHandler"]


class DistributedSignalHandler:
    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> DistributedSignalHandler:
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self._previous)

    def _record(self, signum, frame) -> None:
        self._received = True

    def received(self) -> bool:
        """Whether any rank got the signal (collective over the default group)."""
        flag = torch.tensor([1.0 if self._received else 0.0])
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
