"""Benchmark: mp-ckpt save/load GB/s, async-save blocking time, offline-convert peak memory.

Three measures, each beside its baseline taken in the same run:

save_throughput / load_throughput
    One process (no torch.distributed) saves a state of --gib GiB of fp32
    tensors (--tensors of equal size, [rows, 1024]) with
    `Checkpointer(dir).save(...)` and loads it back with
    `load_checkpoint(dir, pieces)` into preallocated, already-touched tensors.
    The baseline is the disk itself on the same total size: plain Python
    writes a file in 64 MiB blocks then os.fsync, and reads it back in 64 MiB
    blocks. The page cache is dropped (os.sync, then 3 > /proc/sys/vm/drop_caches)
    before every timed operation; that needs root, and when it fails the JSON
    says so (page_cache_dropped: false) and the reads may come from memory.
    A save includes the sha256 of every file it wrote (checksums.json); a
    default load includes verifying them, so load is also timed with
    verify=False. Target: save >= 0.7x the disk's write speed.

async_save_blocking
    The time `Checkpointer(dir, async_save=True).save(...)` blocks its caller
    (until it returns: the host staging copy) beside a synchronous save of the
    same state to another directory. One Checkpointer saves repeatedly, as in
    training, after `prepare(state)` allocated its host buffers (as mp-train
    does at start; its time is reported as prepare_s): every save copies into
    them (blocked_s: the best; first_save_blocked_s: the first). finalize()
    then waits for the write, and the async checkpoint must load equal to the
    state.
    Target: blocking <= 10% of the synchronous save.

convert_peak_rss
    A GPT-like checkpoint (vocabulary 65,536 x hidden 1,024: the word
    embedding and an untied output layer of 256 MiB each, the largest tensors;
    4 layers of q/k/v, proj, fc1 gate and up, fc2, norms: 768 MiB) is
    converted by
    `python -m mp_ckpt.cli convert SRC OUT --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2` in a subprocess, and its peak RSS taken
    from getrusage(RUSAGE_CHILDREN) once it exits. The baseline is the fixed
    overhead: the peak RSS of a process that imports torch and mp_ckpt and
    does nothing. Target: peak <= 2 x largest tensor + fixed overhead.

export_hf_peak_rss
    The same for `mp-ckpt export-hf SRC OUT --arch llama --max-shard-size
    300MB` on that checkpoint (no target; the ratio is reported alike).

Every timing is the best of --repeats, the figure and its baseline taking
turns. Free disk space (shutil.disk_usage) and available memory are checked
first; the state shrinks to fit, and the JSON says from what.

    uv run python ci/bench/bench_ckpt.py [--gib 2] [--tensors 64] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import context, emit, peak_rss

from mp_ckpt import Checkpointer, CheckpointReader, ShardedTensor, load_checkpoint

GIB, MIB = 2**30, 2**20
BLOCK = 64 * MIB
COLUMNS = 1024
SAVE_TARGET, ASYNC_TARGET, CONVERT_TARGET = 0.7, 0.10, 2.0
VOCAB, HIDDEN, FFN, GROUPS, HEAD_DIM, LAYERS = 65536, 1024, 4096, 8, 128, 4
CONVERT_DISK = 2 * GIB  # the GPT-like source and its converted copy, with room to spare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="total size of the saved state")
    parser.add_argument("--tensors", type=int, default=64, help="tensors the state is split into")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many, per timing")
    parser.add_argument("--dir", help="where to write (default: the system's temporary folder)")
    args = parser.parse_args()
    ctx = context()
    work = Path(tempfile.mkdtemp(prefix="mp-ckpt-bench-", dir=args.dir))
    try:
        total, note = _fit(args.gib, args.tensors, work)
        if note:
            print(note, flush=True)
        state = _state(total, args.tensors)
        _throughput(state, work, args.repeats, note, ctx)
        _async_blocking(state, work, args.repeats, note, ctx)
        del state
        _convert_memory(work, ctx)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the states ---------------------------------------------------------------------------


def _fit(gib: float, tensors: int, work: Path) -> tuple[int, str | None]:
    """The state's bytes: --gib, shrunk to the free disk (two checkpoints of it live at once
    during the async measure, plus the convert's) and to the available memory (the state,
    a load target and the async staging copy)."""
    want = int(gib * GIB)
    free_disk = shutil.disk_usage(work).free
    by_disk = (free_disk - CONVERT_DISK - GIB) // 2
    by_memory = (_available_memory() - 2 * GIB) // 3
    total = min(want, by_disk, by_memory)
    granule = tensors * COLUMNS * 4
    total -= total % granule
    if total < 64 * MIB:
        raise SystemExit(
            f"not enough room for a meaningful state: {free_disk / GIB:.1f} GiB free on disk "
            f"under {work}, {_available_memory() / GIB:.1f} GiB of memory available"
        )
    if total == want - want % granule:
        return total, None
    why = "disk" if by_disk < by_memory else "memory"
    return total, (
        f"state shrunk from {gib} GiB to {total / GIB:.2f} GiB to fit the free {why} "
        f"({free_disk / GIB:.1f} GiB disk, {_available_memory() / GIB:.1f} GiB memory)"
    )


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * GIB  # not Linux: assume enough


def _state(total: int, tensors: int) -> dict[str, ShardedTensor]:
    rows = total // (tensors * COLUMNS * 4)
    generator = torch.Generator().manual_seed(0)
    return {
        f"layers.{i}.weight": _whole(f"layers.{i}.weight", torch.rand(rows, COLUMNS,
                                                                      generator=generator))
        for i in range(tensors)
    }  # fmt: skip


def _whole(key: str, data: torch.Tensor) -> ShardedTensor:
    return ShardedTensor(key, data, tuple(data.shape), (0,) * data.dim())


def _targets(state: dict[str, ShardedTensor]) -> dict[str, ShardedTensor]:
    """Zeroed tensors of the state's shapes: touched before timing, as a model's are."""
    return {k: _whole(p.key, torch.zeros_like(p.data)) for k, p in state.items()}


def _equal(state: dict[str, ShardedTensor], loaded: dict[str, ShardedTensor]) -> bool:
    return all(torch.equal(p.data, loaded[k].data) for k, p in state.items())


def _gpt_like() -> dict[str, ShardedTensor]:
    """Logical tensors under the names gpt_layout.py cuts (fp32, 768 MiB in all)."""
    generator = torch.Generator().manual_seed(1)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator)

    logical = {
        "embedding.word_embeddings.weight": tensor(VOCAB, HIDDEN),
        "output_layer.weight": tensor(VOCAB, HIDDEN),
        "decoder.final_layernorm.weight": tensor(HIDDEN),
    }
    for i in range(LAYERS):
        layer = f"decoder.layers.{i}."
        logical |= {
            layer + "input_layernorm.weight": tensor(HIDDEN),
            layer + "self_attention.linear_qkv.q.weight": tensor(GROUPS, 1, HEAD_DIM, HIDDEN),
            layer + "self_attention.linear_qkv.k.weight": tensor(GROUPS, HEAD_DIM, HIDDEN),
            layer + "self_attention.linear_qkv.v.weight": tensor(GROUPS, HEAD_DIM, HIDDEN),
            layer + "self_attention.linear_proj.weight": tensor(HIDDEN, GROUPS * HEAD_DIM),
            layer + "pre_mlp_layernorm.weight": tensor(HIDDEN),
            layer + "mlp.linear_fc1.gate.weight": tensor(FFN, HIDDEN),
            layer + "mlp.linear_fc1.up.weight": tensor(FFN, HIDDEN),
            layer + "mlp.linear_fc2.weight": tensor(HIDDEN, FFN),
        }
    return {k: _whole(k, t) for k, t in logical.items()}


# --- the disk ---------------------------------------------------------------------------


def _drop_page_cache() -> bool:
    """Writes dirty pages out, then asks the kernel to drop its page cache (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _disk_write(path: Path, total: int) -> float:
    block = memoryview(os.urandom(BLOCK))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for done in range(0, total, BLOCK):
            f.write(block[: min(BLOCK, total - done)])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def _disk_read(path: Path) -> float:
    buffer = bytearray(BLOCK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def _sha256_rate() -> float:
    """Bytes per second of hashlib's sha256 over data in memory (what checksums cost)."""
    data = os.urandom(256 * MIB)
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / (time.perf_counter() - start)


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


# --- (a) save and load throughput ---------------------------------------------------------


def _throughput(state, work: Path, repeats: int, note: str | None, ctx) -> None:
    total = sum(p.data.nbytes for p in state.values())
    targets = _targets(state)
    root, plain = work / "throughput", work / "disk.bin"
    best = {"disk_write": [], "disk_read": [], "save": [], "load": [], "load_no_verify": []}
    dropped = True
    loads_equal = True
    for _ in range(repeats):
        dropped &= _drop_page_cache()
        best["disk_write"].append(_disk_write(plain, total))
        dropped &= _drop_page_cache()
        best["disk_read"].append(_disk_read(plain))
        plain.unlink()
        shutil.rmtree(root, ignore_errors=True)
        dropped &= _drop_page_cache()
        best["save"].append(_timed(Checkpointer(root).save, 1, state))
        for name, verify in (("load", True), ("load_no_verify", False)):
            for piece in targets.values():
                piece.data.zero_()
            dropped &= _drop_page_cache()
            best[name].append(_timed(lambda v=verify: load_checkpoint(root, targets, verify=v)))
            loads_equal &= _equal(state, targets)
    shutil.rmtree(root, ignore_errors=True)
    seconds = {k: min(v) for k, v in best.items()}
    rate = {k: total / s / 1e9 for k, s in seconds.items()}
    shape = {
        "bytes": total, "tensors": len(state), "dtype": "float32", "repeats": repeats,
        "page_cache_dropped": dropped, "sha256_gb_per_s": round(_sha256_rate() / 1e9, 3),
        "seconds": {k: round(s, 3) for k, s in seconds.items()},
        **({"note": note} if note else {}),
    }  # fmt: skip
    if not dropped:
        shape["caveat"] = "the page cache could not be dropped: reads may come from memory"
    ratio = rate["save"] / rate["disk_write"]
    emit(
        "save_throughput",
        {
            "gb_per_s": round(rate["save"], 3),
            "disk_write_gb_per_s": round(rate["disk_write"], 3),
            "ratio": round(ratio, 3),
            "target_ratio": SAVE_TARGET,
            "meets_target": ratio >= SAVE_TARGET,
            "includes": "DCP write + fsync, sha256 of every file, metadata, commit",
            **shape,
        },
        ctx,
    )
    emit(
        "load_throughput",
        {
            "gb_per_s": round(rate["load"], 3),
            "gb_per_s_no_verify": round(rate["load_no_verify"], 3),
            "disk_read_gb_per_s": round(rate["disk_read"], 3),
            "ratio": round(rate["load"] / rate["disk_read"], 3),
            "ratio_no_verify": round(rate["load_no_verify"] / rate["disk_read"], 3),
            "target_ratio": None,
            "meets_target": None,
            "loads_equal": loads_equal,
            "includes": "sha256 verification of every file (not with verify=False), DCP read",
            **shape,
        },
        ctx,
    )


# --- (b) async save -------------------------------------------------------------------------


def _async_blocking(state, work: Path, repeats: int, note: str | None, ctx) -> None:
    sync_root, async_root = work / "sync", work / "async"
    sync_s, blocked_s, written_s = [], [], []
    # One Checkpointer for the whole run, as the training loop keeps it, its host staging
    # buffers allocated at start (prepare): every save copies into them.
    checkpointer = Checkpointer(async_root, async_save=True, keep_last=1)
    prepare_s = _timed(checkpointer.prepare, state)
    for iteration in range(repeats):
        shutil.rmtree(sync_root, ignore_errors=True)
        _drop_page_cache()
        sync_s.append(_timed(Checkpointer(sync_root).save, 1, state))
        _drop_page_cache()
        start = time.perf_counter()
        checkpointer.save(iteration + 1, state)
        blocked_s.append(time.perf_counter() - start)
        checkpointer.finalize()
        written_s.append(time.perf_counter() - start)
    targets = _targets(state)
    load_checkpoint(async_root, targets)
    loads_equal = _equal(state, targets)
    del targets
    for root in (sync_root, async_root):
        shutil.rmtree(root, ignore_errors=True)
    ratio = min(blocked_s) / min(sync_s)
    emit(
        "async_save_blocking",
        {
            "blocked_s": round(min(blocked_s), 3),
            "first_save_blocked_s": round(blocked_s[0], 3),
            "prepare_s": round(prepare_s, 3),
            "sync_save_s": round(min(sync_s), 3),
            "ratio": round(ratio, 4),
            "target_ratio": ASYNC_TARGET,
            "meets_target": ratio <= ASYNC_TARGET,
            "async_until_finalized_s": round(min(written_s), 3),
            "async_loads_equal": loads_equal,
            "bytes": sum(p.data.nbytes for p in state.values()),
            "tensors": len(state),
            "repeats": repeats,
            **({"note": note} if note else {}),
        },
        ctx,
    )


# --- (c) offline convert peak memory --------------------------------------------------------


def _convert_memory(work: Path, ctx) -> None:
    source, out = work / "gpt_source", work / "gpt_converted"
    logical = _gpt_like()
    sizes = {k: p.data.nbytes for k, p in logical.items()}
    largest_key = max(sizes, key=sizes.__getitem__)
    largest, total = sizes[largest_key], sum(sizes.values())
    Checkpointer(source).save(1, logical, common={"iteration": 1})
    embedding = logical["embedding.word_embeddings.weight"].data.clone()
    del logical

    baseline_kib, _ = peak_rss([sys.executable, "-c", "import torch, mp_ckpt"])
    command = ["convert", str(source), str(out), "--tensor-model-parallel-size", "2",
               "--pipeline-model-parallel-size", "2", "--no-progress"]  # fmt: skip
    peak_kib, seconds = peak_rss([sys.executable, "-m", "mp_ckpt.cli", *command])
    converted = CheckpointReader(out).read("embedding.word_embeddings.weight")
    converted_equal = torch.equal(converted, embedding)
    peak, baseline = peak_kib * 1024, baseline_kib * 1024
    limit = CONVERT_TARGET * largest + baseline
    emit(
        "convert_peak_rss",
        {
            "peak_rss_mib": round(peak / MIB, 1),
            "fixed_overhead_rss_mib": round(baseline / MIB, 1),
            "largest_tensor_mib": round(largest / MIB, 1),
            "largest_tensor": largest_key,
            "checkpoint_mib": round(total / MIB, 1),
            "peak_above_overhead_mib": round((peak - baseline) / MIB, 1),
            "ratio": round((peak - baseline) / largest, 3),
            "target_ratio": CONVERT_TARGET,
            "limit_mib": round(limit / MIB, 1),
            "meets_target": peak <= limit,
            "convert_s": round(seconds, 2),
            "converted_equal": converted_equal,
            "convert_command": "mp-ckpt " + " ".join(command).replace(str(work), "$WORK"),
            "ratio_means": "(peak - fixed overhead) / largest tensor",
        },
        ctx,
    )
    # export-hf on the same checkpoint: no target, the same measure.
    hf = work / "gpt_hf"
    command = ["export-hf", str(source), str(hf), "--arch", "llama", "--max-shard-size", "300MB"]
    peak_kib, seconds = peak_rss([sys.executable, "-m", "mp_ckpt.cli", *command])
    peak = peak_kib * 1024
    emit(
        "export_hf_peak_rss",
        {
            "peak_rss_mib": round(peak / MIB, 1),
            "fixed_overhead_rss_mib": round(baseline / MIB, 1),
            "largest_tensor_mib": round(largest / MIB, 1),
            "checkpoint_mib": round(total / MIB, 1),
            "peak_above_overhead_mib": round((peak - baseline) / MIB, 1),
            "ratio": round((peak - baseline) / largest, 3),
            "export_s": round(seconds, 2),
            "files": sorted(p.name for p in hf.iterdir()),
            "export_command": "mp-ckpt " + " ".join(command).replace(str(work), "$WORK"),
            "ratio_means": "(peak - fixed overhead) / largest tensor",
        },
        ctx,
    )


if __name__ == "__main__":
    main()
