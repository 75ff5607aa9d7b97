"""--profile's window on one process, and the TensorBoard and profiling options as
Megatron-LM spells them."""

from __future__ import annotations

import json

import pytest
import torch

from mp_train import LoggingConfig
from mp_train.configuration.arguments import parse_config
from mp_train.observability.profiling import StepProfiler

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--train-iters", "10", "--mock-data"]  # fmt: skip


def profiled(tmp_path, start: int, end: int, iterations: range, rank: int = 0,
             ranks: list[int] | None = None) -> list[set[str]]:  # fmt: skip
    """The `iteration <n>` ranges of each trace written while running `iterations`."""
    config = LoggingConfig(tensorboard_dir=str(tmp_path), profile=True, profile_step_start=start,
                           profile_step_end=end, profile_ranks=ranks or [])  # fmt: skip
    profiler = StepProfiler(config, rank, torch.device("cpu"))
    for iteration in iterations:
        profiler.iteration_started(iteration)
        torch.ones(8, 8) @ torch.ones(8, 8)
        profiler.iteration_finished(iteration)
    profiler.close()
    ranges = []
    for path in sorted(tmp_path.glob(f"rank{rank}.*.pt.trace.json")):
        events = json.loads(path.read_text())["traceEvents"]
        ranges.append({e["name"] for e in events if e.get("name", "").startswith("iteration ")})
    return ranges


def one_matmul_profiled(folder, **options) -> tuple[dict, list[dict]]:
    """The trace's aten::mm event, and all its events, of one profiled 8x4 @ 4x2."""
    config = LoggingConfig(tensorboard_dir=str(folder), profile=True, profile_step_start=1,
                           profile_step_end=2, **options)  # fmt: skip
    profiler = StepProfiler(config, 3, torch.device("cpu"))
    profiler.iteration_started(1)
    torch.ones(8, 4) @ torch.ones(4, 2)
    profiler.iteration_finished(1)
    (trace,) = folder.glob("rank3.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    (matmul,) = [e for e in events if e.get("name") == "aten::mm"]
    return matmul, events


def test_shapes_call_stacks_and_the_execution_trace_when_asked(tmp_path):
    matmul, events = one_matmul_profiled(
        tmp_path, pytorch_profiler_collect_shapes=True, pytorch_profiler_collect_callstack=True,
        pytorch_profiler_collect_chakra=True,
    )  # fmt: skip
    assert matmul["args"]["Input Dims"] == [[8, 4], [4, 2]]
    assert any("test_profiling.py" in e.get("name", "") for e in events)  # the Python stack
    nodes = json.loads((tmp_path / "chakra" / "rank3.json").read_text())["nodes"]
    assert any(node["name"] == "aten::mm" for node in nodes)
    plain = tmp_path / "plain"
    matmul, events = one_matmul_profiled(plain)
    assert "Input Dims" not in matmul.get("args", {}) and not (plain / "chakra").exists()
    assert not any("test_profiling.py" in e.get("name", "") for e in events)


def test_profiles_start_to_end_exclusive(tmp_path):
    assert profiled(tmp_path, 3, 5, range(1, 8)) == [{"iteration 3", "iteration 4"}]


def test_a_resumed_run_inside_the_window_profiles_the_rest(tmp_path):
    assert profiled(tmp_path, 3, 6, range(5, 8)) == [{"iteration 5"}]


def test_a_run_ending_inside_the_window_writes_what_it_profiled(tmp_path):
    assert profiled(tmp_path, 2, 6, range(1, 4)) == [{"iteration 2", "iteration 3"}]


def test_only_the_profile_ranks_profile(tmp_path):
    assert profiled(tmp_path, 1, 2, range(1, 3), rank=1, ranks=[0]) == []
    assert profiled(tmp_path, 1, 2, range(1, 3), rank=1) == [{"iteration 1"}]  # []: all


def test_profile_needs_a_tensorboard_dir_and_a_window():
    with pytest.raises(ValueError, match="profile=True needs tensorboard_dir"):
        LoggingConfig(profile=True)
    with pytest.raises(ValueError, match="profile_step_start=5 and profile_step_end=5"):
        LoggingConfig(profile=True, tensorboard_dir="tb", profile_step_start=5,
                      profile_step_end=5)  # fmt: skip
    with pytest.raises(ValueError, match="tensorboard_log_interval=0 must be >= 1"):
        LoggingConfig(tensorboard_log_interval=0)


def test_megatron_defaults_and_flags():
    logging = parse_config(MODEL).logging
    assert (logging.tensorboard_log_interval, logging.tensorboard_queue_size) == (1, 1000)
    assert logging.log_loss_scale_to_tensorboard and not logging.log_timers_to_tensorboard
    assert (logging.profile_step_start, logging.profile_step_end, logging.profile_ranks) == (
        10, 12, [])  # fmt: skip
    logging = parse_config([
        *MODEL, "--tensorboard-dir", "tb", "--tensorboard-log-interval", "5",
        "--tensorboard-queue-size", "10", "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard", "--no-log-loss-scale-to-tensorboard",
        "--no-log-learning-rate-to-tensorboard", "--no-log-batch-size-to-tensorboard",
        "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard", "--profile",
        "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "4",
        "--profile-ranks", "0", "2",
    ]).logging  # fmt: skip
    assert logging == LoggingConfig(
        tensorboard_dir="tb", tensorboard_log_interval=5, tensorboard_queue_size=10,
        log_timers_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
        log_loss_scale_to_tensorboard=False, log_learning_rate_to_tensorboard=False,
        log_batch_size_to_tensorboard=False, log_memory_to_tensorboard=True,
        log_world_size_to_tensorboard=True, profile=True, use_pytorch_profiler=True,
        profile_step_start=3, profile_step_end=4, profile_ranks=[0, 2],
    )  # fmt: skip


def test_memory_tags_on_cpu():
    from mp_train.observability.memory import memory_bytes

    got = memory_bytes(torch.device("cpu"))
    assert sorted(got) == ["mem-allocated-bytes", "mem-max-allocated-bytes"]
    assert 0 < got["mem-allocated-bytes"] <= got["mem-max-allocated-bytes"]


@pytest.mark.cuda
def test_memory_tags_and_profile_on_cuda(tmp_path):
    from mp_train.observability.memory import memory_bytes

    device = torch.device("cuda")
    kept = torch.ones(1024, device=device)
    got = memory_bytes(device)
    assert sorted(got) == ["mem-allocated-bytes", "mem-allocated-count",
                           "mem-max-allocated-bytes", "mem-reserved-bytes"]  # fmt: skip
    assert got["mem-allocated-bytes"] >= kept.numel() * 4
    config = LoggingConfig(tensorboard_dir=str(tmp_path), profile=True, profile_step_start=1,
                           profile_step_end=2)  # fmt: skip
    profiler = StepProfiler(config, 0, device)
    profiler.iteration_started(1)
    (kept @ kept).item()
    profiler.iteration_finished(1)
    (trace,) = tmp_path.glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity recorded


def test_device_memory_used_on_cpu_is_the_hosts_memory_in_use(monkeypatch):
    from mp_train.observability import memory

    used = memory.device_memory_used(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024  # MemTotal, the first line
    resident = memory.memory_mb(torch.device("cpu"))["memory MB"] * 2**20
    assert resident <= used < total  # this process's memory and every other's in use

    def no_meminfo(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr("builtins.open", no_meminfo)
    with pytest.raises(RuntimeError, match="reads /proc/meminfo, which this system does not"):
        memory.device_memory_used(torch.device("cpu"))


def test_memory_history_records_on_its_ranks_and_snapshots_atomically(tmp_path, monkeypatch):
    """record_memory_history's calls into torch (CUDA's allocator is faked here; the test
    below runs it on a GPU): recording starts on the profile_ranks with an out-of-memory
    observer that writes that rank's snapshot; a dump is written whole or not at all."""
    from mp_train.observability import memory

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kwargs: calls.append(("record", kwargs)))  # fmt: skip
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer",
                        lambda fn: calls.append(("observer", fn)))  # fmt: skip
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [1, 2]})
    path = str(tmp_path / "mem" / "snap.pickle")
    config = LoggingConfig(record_memory_history=True, memory_snapshot_path=path,
                           profile_ranks=[1])  # fmt: skip
    cuda = torch.device("cuda")
    assert not memory.start_memory_history(config, 0, cuda)  # not a profile rank
    assert not memory.start_memory_history(config, 1, torch.device("cpu"))
    assert calls == []
    assert memory.start_memory_history(config, 1, cuda)
    assert calls[0] == ("record", {"max_entries": 100_000})
    calls[1][1](0, 0, 0, 0)  # the allocator runs out of memory
    oom = tmp_path / "mem" / "snap_oom_rank-1.pickle"
    assert __import__("pickle").loads(oom.read_bytes()) == {"segments": [1, 2]}
    memory.dump_memory_snapshot(path)
    assert sorted(p.name for p in (tmp_path / "mem").iterdir()) == [
        "snap.pickle", "snap_oom_rank-1.pickle"]  # fmt: skip


@pytest.mark.cuda
def test_memory_history_snapshot_on_cuda(tmp_path):
    import pickle

    from mp_train.observability import memory

    path = tmp_path / "snap.pickle"
    config = LoggingConfig(record_memory_history=True, memory_snapshot_path=str(path))
    assert memory.start_memory_history(config, 0, torch.device("cuda"))
    try:
        kept = torch.ones(1 << 20, device="cuda")
        memory.dump_memory_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = pickle.loads(path.read_bytes())
    assert kept.numel() and snapshot["device_traces"][0]  # the allocation's event
