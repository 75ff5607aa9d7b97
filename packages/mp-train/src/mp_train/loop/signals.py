"""SIGTERM (or another exit_signal) handled by every rank together (Megatron's
DistributedSignalHandler).

A scheduler (SLURM, Kubernetes) may send SIGTERM to one rank or to all, at
any moment. The handler only records it; once per iteration the loop asks
`received()`, an all-reduce over every rank, so that all of them agree to
stop after the same iteration, save, and exit 0. The data loaders' worker processes,
which a scheduler may signal too (SLURM signals every process of a job step), ignore
the exit signal (`workers_ignored_signals`): the loop stops them when the run ends.

exit_signal_handler_for_training (Megatron's) is the other way to end on a signal:
SIGINT or SIGTERM ends the rank at once, without a save, with one line and exit 0
(`shutdown_on_signals`, TrainingShutdown) instead of a traceback or a kill.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mp_train.configuration.run_checks import check_exit_signal

__all__ = [
    "DistributedSignalHandler",
    "TrainingShutdown",
    "shutdown_on_signals",
    "workers_ignored_signals",
]

_SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def workers_ignored_signals(training) -> tuple[int, ...]:
    """The signals the loaders' workers ignore, which the training handles: exit_signal
    under exit_signal_handler, SIGINT and SIGTERM under exit_signal_handler_for_training."""
    ignored = set()
    if training.exit_signal_handler:
        ignored.add(check_exit_signal(training.exit_signal))
    if training.exit_signal_handler_for_training:
        ignored.update(int(s) for s in _SHUTDOWN_SIGNALS)
    return tuple(sorted(ignored))


class TrainingShutdown(SystemExit):
    """exit_signal_handler_for_training: SIGINT or SIGTERM ended the run on this rank, with
    exit status 0 (Megatron's orderly shutdown, without a save)."""

    def __init__(self, reason: str) -> None:
        super().__init__(0)
        self.reason = reason


@contextlib.contextmanager
def shutdown_on_signals(enabled: bool) -> Iterator[None]:
    """With `enabled`, SIGINT and SIGTERM raise TrainingShutdown where the rank is (its
    finally blocks run: a background save in flight is finished, loaders are stopped)."""
    if not enabled:
        yield
        return

    def shut_down(signum, frame):
        raise TrainingShutdown(f"{signal.Signals(signum).name} received")

    previous = {sig: signal.signal(sig, shut_down) for sig in _SHUTDOWN_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
