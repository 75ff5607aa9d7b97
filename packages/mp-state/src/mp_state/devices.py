"""Where a rank computes and how it talks: the one place that decides.

CUDA + NCCL when a GPU is visible, CPU + gloo otherwise; the local rank comes
from torchrun's environment (LOCAL_RANK), so one process per GPU picks its own.

MP_DEVICE overrides the choice: `cpu` keeps a process on the CPU with gloo on a
machine with GPUs (and never asks torch about CUDA, so a rank forked from a process
that has used CUDA runs), `cuda` insists on a GPU and fails at once without one.
Unset or empty, the choice is automatic. The test suite runs with MP_DEVICE=cpu
except for the tests marked `cuda` (docs/testing.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "DEVICE_ENV",
    "DeviceInfo",
    "device_type",
    "init_distributed",
    "local_rank",
    "select_device",
]

DEVICE_ENV = "MP_DEVICE"
"""The environment variable that overrides the device: cpu, cuda, or unset (automatic)."""


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    """The device this rank computes on."""

    backend: str
    """The torch.distributed backend for that device: "nccl" or "gloo"."""

    local_rank: int
    """This rank's index on its node."""


def local_rank() -> int:
    """This process's rank on its node, from torchrun's LOCAL_RANK (0 when unset)."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        rank = int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={value!r} is not an integer") from None
    if rank < 0:
        raise ValueError(f"LOCAL_RANK={rank} must be >= 0")
    return rank


def device_type() -> str:
    """Where this process computes, "cuda" or "cpu": MP_DEVICE when set, else "cuda"
    when torch sees a GPU.

    With MP_DEVICE=cpu torch is not asked about CUDA at all."""
    chosen = os.environ.get(DEVICE_ENV, "")
    if chosen == "cpu":
        return "cpu"
    if chosen not in ("", "cuda"):
        raise ValueError(
            f"{DEVICE_ENV}={chosen!r}: expected cpu or cuda (or unset: CUDA when a GPU is "
            "visible, else the CPU)"
        )
    available = torch.cuda.is_available()
    if chosen == "cuda" and not available:
        raise ValueError(f"{DEVICE_ENV}=cuda needs a CUDA device and none is visible")
    return "cuda" if available else "cpu"


def select_device(backend: str | None = None) -> DeviceInfo:
    """CUDA device LOCAL_RANK (mod the visible count) with NCCL, else the CPU with gloo
    (device_type() decides, MP_DEVICE first). `backend` (Megatron's
    --distributed-backend) overrides the backend: gloo on CUDA devices, or nccl, which
    needs CUDA."""
    rank = local_rank()
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"--distributed-backend {backend!r}: expected nccl or gloo")
    if device_type() == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        return DeviceInfo(device, backend or "nccl", rank)
    if backend == "nccl":
        if os.environ.get(DEVICE_ENV) == "cpu":
            raise ValueError(
                f"--distributed-backend nccl needs CUDA devices and {DEVICE_ENV}=cpu keeps "
                f"this process on the CPU: use --distributed-backend gloo or unset {DEVICE_ENV}"
            )
        raise ValueError(
            "--distributed-backend nccl needs CUDA devices and none is visible: use "
            "--distributed-backend gloo (the default without a GPU)"
        )
    return DeviceInfo(torch.device("cpu"), "gloo", rank)


def init_distributed(timeout_minutes: float = 10, backend: str | None = None) -> DeviceInfo:
    """Initializes torch.distributed for this rank from torchrun's environment, with
    `backend` or the device's own (nccl on CUDA, gloo on a CPU).

    Without torchrun (no RANK / WORLD_SIZE set) it makes a one-rank world, so a
    script runs unchanged as `python script.py`. An already initialized default
    group is kept. On CUDA the rank's device becomes the current one, and under NCCL the
    group is bound to it (device_id, as Megatron-LM binds it): the communicator forms at
    once, subgroups split from it, and NCCL does not guess the device from the rank.
    Under torchrun's --max-restarts, each attempt's workers meet under keys of their own
    in its store.
    """
    info = select_device(backend)
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if dist.is_initialized():
        return info
    timeout = timedelta(minutes=timeout_minutes)
    bound = {"device_id": info.device} if info.backend == "nccl" else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        # torchrun's store outlives a restart of its workers (--max-restarts): without a
        # prefix per attempt, a restarted rank can read the dead workers' addresses and
        # fail to connect. The default group's own prefix is kept inside it.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"mp/attempt_{attempt}/default_pg", store)
        dist.init_process_group(
            info.backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
            **bound,
        )  # fmt: skip
    else:
        dist.init_process_group(
            info.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
            **bound,
        )  # fmt: skip
    return info
