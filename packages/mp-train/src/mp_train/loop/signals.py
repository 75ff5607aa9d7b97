"""SIGTERM (or another exit_signal) handled by every rank together (Megatron's
DistributedSignalHandler).

A scheduler (SLURM, Kubernetes) may send SIGTERM to one rank or to all, at
any moment. The handler only records it; once per iteration the loop asks
`received()`, an all-reduce over every rank, so that all of them agree to
stop after the same iteration, save, and exit 0. The data loaders' worker processes,
which a scheduler may signal too (SLURM signals every process of a job step), ignore
the exit signal (`workers_ignored_signal`): the loop stops them when the run ends.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from mp_train.configuration.run_checks import check_exit_signal

__all__ = ["DistributedSignalHandler", "workers_ignored_signal"]


def workers_ignored_signal(training) -> int | None:
    """The signal the loaders' workers ignore: exit_signal under exit_signal_handler."""
    return check_exit_signal(training.exit_signal) if training.exit_signal_handler else None


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
