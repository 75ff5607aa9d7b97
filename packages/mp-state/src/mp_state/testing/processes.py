"""What tests that start real jobs (torchrun, its workers, their data-loader workers) read
of the processes, from Linux's /proc: children, a worker's rank, whether one is alive."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "children", "rank_of", "workers_of"]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, in pid order."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(entry.name)
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def rank_of(pid: int) -> int | None:
    """The RANK a launcher gave the process (None: none, or the process is gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v[len(b"RANK=") :]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def workers_of(pid: int) -> dict[int, int]:
    """The children of `pid` that have a RANK (torchrun's workers), by rank."""
    found = {}
    for child in children(pid):
        rank = rank_of(child)
        if rank is not None:
            found[rank] = child
    return found


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"
