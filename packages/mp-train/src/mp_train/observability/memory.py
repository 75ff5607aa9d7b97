"""Memory figures for the log: what this process holds (CUDA's allocator statistics, or
the process's resident memory on a CPU), and what the whole device holds
(log_device_memory_used)."""

from __future__ import annotations

import os
import pickle
import resource
import sys

import torch

__all__ = [
    "device_memory_used",
    "dump_memory_snapshot",
    "memory_bytes",
    "memory_mb",
    "start_memory_history",
]

HISTORY_ENTRIES = 100_000
"""The allocator events record_memory_history keeps (Megatron's number)."""


def memory_mb(device: torch.device) -> dict[str, float]:
    """The log line's memory: allocated and peak CUDA memory, or the process's resident
    and peak resident memory on CPUs."""
    if device.type == "cuda":
        return {
            "memory MB": torch.cuda.memory_allocated(device) / 2**20,
            "peak memory MB": torch.cuda.max_memory_allocated(device) / 2**20,
        }
    current, peak = _process_memory_bytes()
    return {"memory MB": current / 2**20, "peak memory MB": peak / 2**20}


def device_memory_used(device: torch.device) -> int:
    """Bytes in use on the whole device by every process (NVML's, as nvidia-smi), or on a
    CPU the host's memory in use: MemTotal - MemAvailable (/proc/meminfo). Raises
    RuntimeError naming what is missing (NVML's Python bindings, /proc/meminfo)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.device_memory_used(device))
        except ModuleNotFoundError as error:
            raise RuntimeError(f"log_device_memory_used needs NVML's Python bindings "
                               f"(pip install nvidia-ml-py): {error}") from None  # fmt: skip
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return (info["MemTotal"] - info["MemAvailable"]) * 1024
    except (OSError, KeyError, ValueError, IndexError) as error:
        raise RuntimeError(
            f"log_device_memory_used on a CPU reads /proc/meminfo, which this system does not "
            f"give ({error})"
        ) from None


def memory_bytes(device: torch.device) -> dict[str, int]:
    """Megatron's mem-* TensorBoard tags from CUDA's memory statistics; on CPUs the
    process's resident and peak resident bytes as the allocated and peak allocated."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"],
        }
    current, peak = _process_memory_bytes()
    return {"mem-allocated-bytes": current, "mem-max-allocated-bytes": peak}


def _process_memory_bytes() -> tuple[int, int]:
    """This process's resident and peak resident bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if sys.platform == "darwin":
        peak //= 1024  # bytes on macOS
    current = peak
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return current, max(current, peak)  # the kernel's peak may lag the current


def start_memory_history(config, rank: int, device: torch.device) -> bool:
    """record_memory_history on this rank (one of the profile_ranks, or any when none are
    named): the CUDA caching allocator records its events with their stacks from now on,
    and running out of memory writes this rank's snapshot. Whether it records."""
    if not config.record_memory_history or device.type != "cuda":
        return False
    if config.profile_ranks and rank not in config.profile_ranks:
        return False
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    base, ext = os.path.splitext(config.memory_snapshot_path)
    oom_path = f"{base}_oom_rank-{rank}{ext}"

    def on_out_of_memory(device_index, allocated, device_allocated, device_free):
        dump_memory_snapshot(oom_path)

    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)
    return True


def dump_memory_snapshot(path: str) -> None:
    """The allocator's snapshot, history included, pickled to `path` (written under a
    temporary name, then renamed)."""
    snapshot = torch.cuda.memory._snapshot()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    partial = f"{path}.tmp{os.getpid()}"
    with open(partial, "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(partial, path)
