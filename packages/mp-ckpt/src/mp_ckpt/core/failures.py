"""Reading a failure for its one-line report: torch.distributed.checkpoint's
CheckpointException gathers every rank's error, and the cause that matters (a full
disk) can sit deep in a chain of exceptions."""

from __future__ import annotations

__all__ = ["failure_line", "has_errno"]


def failure_line(error: BaseException, rank: int) -> str:
    """The error's first line; for a CheckpointException, the failure of `rank`, or
    (when `rank` did not fail) the first failing rank's, named."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        if rank in failures:
            return _first_line(failures[rank][0])
        first, (cause, _) = next(iter(failures.items()))
        return f"checkpoint failed on rank {first}: {_first_line(cause)}"
    return _first_line(error)


def has_errno(error: BaseException | None, number: int) -> bool:
    """Whether an OSError with errno `number` is in the error's chain of causes, or in
    the chains of the failures a CheckpointException gathered."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == number:
            return True
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and any(
            has_errno(cause, number) for cause, _ in failures.values()
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
