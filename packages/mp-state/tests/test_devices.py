"""Device selection, LOCAL_RANK, and init_distributed with and without torchrun."""

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from mp_state import DeviceInfo, device_type, init_distributed, local_rank, select_device
from mp_state.testing import run_on_ranks


def test_local_rank_from_torchrun_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "three")
    with pytest.raises(ValueError, match="LOCAL_RANK='three' is not an integer"):
        local_rank()
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match="LOCAL_RANK=-1 must be >= 0"):
        local_rank()


def test_select_device_and_the_mp_device_override(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    # MP_DEVICE=cpu (the suite's own setting): the CPU and gloo, with or without a GPU.
    monkeypatch.setenv("MP_DEVICE", "cpu")
    assert device_type() == "cpu"
    assert select_device() == DeviceInfo(torch.device("cpu"), "gloo", 3)
    with pytest.raises(ValueError, match="nccl needs CUDA devices and MP_DEVICE=cpu keeps"):
        select_device("nccl")
    monkeypatch.setenv("MP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="MP_DEVICE='tpu': expected cpu or cuda"):
        select_device()
    # Unset or empty: CUDA when torch sees a GPU (two GPUs here: local rank 3 takes the
    # second), else the CPU; MP_DEVICE=cuda insists on one.
    monkeypatch.setenv("MP_DEVICE", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device() == DeviceInfo(torch.device("cuda", 1), "nccl", 3)
    assert select_device("gloo") == DeviceInfo(torch.device("cuda", 1), "gloo", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device() == DeviceInfo(torch.device("cpu"), "gloo", 3)
    with pytest.raises(ValueError, match="nccl needs CUDA devices and none is visible"):
        select_device("nccl")
    monkeypatch.setenv("MP_DEVICE", "cuda")
    with pytest.raises(ValueError, match="MP_DEVICE=cuda needs a CUDA device and none is"):
        select_device()


def single_process_init():
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    info = init_distributed()
    t = torch.ones(1)
    dist.all_reduce(t)
    result = (dist.get_world_size(), dist.get_backend(), info.backend, t.item())
    dist.destroy_process_group()
    return result


def test_init_distributed_without_torchrun_makes_a_one_rank_world():
    [result] = run_on_ranks(single_process_init, 1, init_process_group=False)
    assert result == (1, "gloo", "gloo", 1.0)


def env_init(port: int):
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(timeout_minutes=1)
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    result = (dist.get_rank(), dist.get_world_size(), t.item())
    dist.destroy_process_group()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_distributed_from_torchrun_variables():
    # run_on_ranks sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR as torchrun does.
    results = run_on_ranks(env_init, 2, free_port(), init_process_group=False, timeout=60)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


SCRIPT = """
    import torch, torch.distributed as dist
    import mp_state
    info = mp_state.init_distributed(timeout_minutes=1)
    state = mp_state.initialize(mp_state.ParallelConfig(tensor_model_parallel_size=2))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=state.tp.group)
    print(f"rank={dist.get_rank()} local_rank={info.local_rank} tp_sum={t.item()}", flush=True)
    mp_state.destroy()
    dist.destroy_process_group()
"""


def torchrun(tmp_path, script: str, nproc: int, **env: str) -> str:
    """What `script` printed under torchrun with `nproc` workers; fails if it failed."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", "--log-dir", str(tmp_path / "torchrun-logs"), str(path)],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.multirank
def test_under_real_torchrun(tmp_path):
    out = torchrun(tmp_path, SCRIPT, 2)
    # Both ranks print to one pipe: their lines may interleave.
    reports = sorted(re.findall(r"rank=\d local_rank=\d tp_sum=[\d.]+", out))
    assert reports == ["rank=0 local_rank=0 tp_sum=1.0", "rank=1 local_rank=1 tp_sum=1.0"]


NCCL_SCRIPT = """
    import torch, torch.distributed as dist
    import mp_state
    info = mp_state.init_distributed(timeout_minutes=1)
    t = torch.full((4,), 2.0, device=info.device)
    dist.all_reduce(t)
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    print(f"backend={dist.get_backend()} device={t.device} sum={t.sum().item()} "
          f"bound={bound}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.cuda
def test_nccl_on_one_gpu_under_torchrun(tmp_path):
    out = torchrun(tmp_path, NCCL_SCRIPT, 1, MP_DEVICE="cuda")
    assert "backend=nccl device=cuda:0 sum=8.0 bound=cuda:0" in out, out


def test_an_nccl_group_is_bound_to_the_ranks_device_and_gloo_to_none(monkeypatch):
    """What init_distributed asks of torch.distributed (a CUDA device made up here)."""
    import mp_state.devices as devices

    asked = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: asked.append((a, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))):
        info = DeviceInfo(device, backend, 1)
        monkeypatch.setattr(devices, "select_device", lambda backend=None, info=info: info)
        init_distributed()
    [(nccl_args, nccl_kw), (gloo_args, gloo_kw)] = asked
    assert nccl_args == ("nccl",) and nccl_kw["device_id"] == torch.device("cuda", 1)
    assert gloo_args == ("gloo",) and "device_id" not in gloo_kw
