"""Save and load: resharding, the commit, integrity, strictness, async saves."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mp_ckpt import (
    CheckpointCorrupted,
    Checkpointer,
    ShardedTensor,
    checkpoint_dir,
    list_iterations,
    load_checkpoint,
    read_metadata,
    read_tracker,
)
from mp_ckpt.core.checkpointer import single_process_quiet
from mp_ckpt.core.integrity import HashingFileSystemWriter, file_digest
from mp_state.testing import run_on_ranks

W = torch.arange(48.0).view(8, 6)
M = torch.arange(30.0).view(5, 6) / 7


def pieces_for(rank: int, world: int, flat_optimizer: bool = True) -> dict:
    """w split by rows over the ranks; m whole (a replica past rank 0) and, as an optimizer
    state would be, cut into flat ranges per rank."""
    rows = 8 // world
    w = W[rank * rows : (rank + 1) * rows].clone()
    out = {"w": ShardedTensor("w", w, (8, 6), (rank * rows, 0))}
    out["m"] = ShardedTensor("m", M.clone(), (5, 6), (0, 0), replica_id=rank)
    if flat_optimizer:
        n = M.numel()
        s, e = n * rank // world, n * (rank + 1) // world
        out["opt.m"] = ShardedTensor("opt.m", (M * 2).reshape(-1)[s:e].clone(), (5, 6), (0, 0),
                                     0, (s, e), (5, 6))  # fmt: skip
    return out


def empty_like(pieces: dict) -> dict:
    return {
        k: ShardedTensor(p.key, torch.full_like(p.data, float("nan")), p.global_shape,
                         p.global_offset, p.replica_id, p.flattened_range, p.local_shape)
        for k, p in pieces.items()
    }  # fmt: skip


def save_body(root, world_async: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpointer = Checkpointer(root, async_save=world_async)
    checkpointer.save(7, pieces_for(rank, world), common={"iteration": 7},
                      rank_state={"rank": rank}, layout={"tp": world})  # fmt: skip
    checkpointer.finalize()


def load_body(root):
    rank, world = dist.get_rank(), dist.get_world_size()
    target = empty_like(pieces_for(rank, world))
    loaded = load_checkpoint(root, target)
    return {k: p.data for k, p in target.items()}, loaded.common, loaded.rank_state


@pytest.mark.multirank
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saved_on_4_ranks_loads_on_2_and_1(tmp_path, async_save):
    run_on_ranks(save_body, 4, str(tmp_path), async_save, timeout=60)
    assert read_tracker(tmp_path) == 7
    meta = read_metadata(checkpoint_dir(tmp_path, 7))
    assert meta["layout"] == {"tp": 4} and meta["tensors"]["w"]["shape"] == [8, 6]
    for world in (2, 1):
        results = run_on_ranks(load_body, world, str(tmp_path), timeout=60)
        for rank, (data, common, rank_state) in enumerate(results):
            want = pieces_for(rank, world)
            for key, piece in want.items():
                torch.testing.assert_close(data[key], piece.data, rtol=0, atol=0, msg=key)
            assert common == {"iteration": 7}
            assert rank_state is None  # saved by 4 ranks: not this layout's


def load_expecting_corruption(root):
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        load_checkpoint(root, empty_like(pieces_for(rank, world)))
    except CheckpointCorrupted as error:
        return str(error)
    return "loaded"


@pytest.mark.multirank
def test_a_bad_data_file_is_named_on_every_rank(tmp_path):
    """The data files are checked while they are read: a corrupted one, or one missing
    (which DCP's read also trips over), is still named by every rank."""
    run_on_ranks(save_body, 2, str(tmp_path), False, timeout=60)
    shard = sorted(checkpoint_dir(tmp_path, 7).glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    for message in run_on_ranks(load_expecting_corruption, 2, str(tmp_path), timeout=60):
        assert f"{shard.name}: sha256 differs" in message
    shard.unlink()
    for message in run_on_ranks(load_expecting_corruption, 2, str(tmp_path), timeout=60):
        assert f"{shard.name}: missing" in message


def test_single_process_round_trip_and_rank_state(tmp_path):
    Checkpointer(tmp_path).save(3, pieces_for(0, 1), common={"a": 1}, rank_state={"rng": 5})
    target = empty_like(pieces_for(0, 1))
    loaded = load_checkpoint(tmp_path, target)
    assert loaded.iteration == 3 and loaded.common == {"a": 1} and loaded.rank_state == {"rng": 5}
    torch.testing.assert_close(target["w"].data, W, rtol=0, atol=0)


def test_prepare_allocates_the_staging_buffers_saves_reuse(tmp_path):
    pieces = pieces_for(0, 1)
    checkpointer = Checkpointer(tmp_path, async_save=True)
    checkpointer.prepare(pieces)
    prepared = {name: buffer.data_ptr() for name, buffer in checkpointer._staging.items()}
    assert len(prepared) == 3  # w, m and opt.m: every replica-0 piece
    pieces["w"].data.add_(1.0)  # the state moves on before the save
    checkpointer.save(1, pieces)
    checkpointer.finalize()
    assert {n: b.data_ptr() for n, b in checkpointer._staging.items()} == prepared
    target = empty_like(pieces_for(0, 1))
    load_checkpoint(tmp_path, target)
    torch.testing.assert_close(target["w"].data, W + 1.0, rtol=0, atol=0)
    Checkpointer(tmp_path / "sync").prepare(pieces)  # nothing to prepare: no staging


def test_a_sibling_saves_elsewhere_sharing_the_staging_and_the_save_in_flight(tmp_path):
    pieces = pieces_for(0, 1)
    checkpointer = Checkpointer(tmp_path / "main", async_save=True, keep_last=5)
    sibling = checkpointer.sibling(tmp_path / "frequent", keep_last=1)
    assert (sibling.async_save, sibling.keep_last, checkpointer.keep_last) == (True, 1, 5)
    checkpointer.prepare(pieces)
    staged = {name: buffer.data_ptr() for name, buffer in checkpointer._staging.items()}
    for iteration in (1, 2, 3):
        pieces["w"].data.add_(1.0)
        sibling.save(iteration, pieces)
    checkpointer.save(4, pieces)  # waits for the sibling's save 3 to commit first
    assert read_tracker(tmp_path / "frequent") == 3
    sibling.finalize()  # either waits for the save in flight, whoever began it
    assert read_tracker(tmp_path / "main") == 4
    assert {n: b.data_ptr() for n, b in sibling._staging.items()} == staged
    assert list_iterations(tmp_path / "frequent") == [3] and read_tracker(tmp_path / "main") == 4
    assert (sibling.last_saved, checkpointer.last_saved) == (3, 4)
    for root, iteration in (("frequent", 3), ("main", 4)):
        target = empty_like(pieces_for(0, 1))
        assert load_checkpoint(tmp_path / root, target).iteration == iteration
        torch.testing.assert_close(target["w"].data, W + 3.0, rtol=0, atol=0)
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        checkpointer.sibling(tmp_path / "x", keep_last=0)


def test_tracker_moves_only_after_a_complete_save_and_keep_last(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    for iteration in (1, 2, 3):
        checkpointer.save(iteration, pieces_for(0, 1))
        assert read_tracker(tmp_path) == iteration
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "iter_0000002", "iter_0000003"
    ]  # fmt: skip
    # An interrupted save leaves only its .tmp directory behind, and the tracker as it was.
    (tmp_path / "iter_0000004.tmp").mkdir()
    assert read_tracker(tmp_path) == 3
    load_checkpoint(tmp_path, empty_like(pieces_for(0, 1)))


@pytest.mark.parametrize(("keep_last", "kept"), [(None, [4, 8, 10]), (2, [4, 8, 9, 10])])
def test_retain_interval_keeps_its_multiples_beside_the_newest(tmp_path, keep_last, kept):
    """Megatron's --save-retain-interval 4: the multiples of 4 stay, with the newest
    keep_last (or the newest alone); each commit reports what it deleted."""
    reported = []
    checkpointer = Checkpointer(tmp_path, keep_last=keep_last, retain_interval=4,
                                on_commit=lambda i, gone: reported.append((i, gone)))  # fmt: skip
    for iteration in range(1, 11):
        checkpointer.save(iteration, pieces_for(0, 1))
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == [f"iter_{i:07d}" for i in kept]
    assert [i for i, _ in reported] == list(range(1, 11))
    gone = sorted(i for _, deleted in reported for i in deleted)
    assert gone == sorted(set(range(1, 11)) - set(kept))


def test_checksums_taken_while_writing_match_the_files(tmp_path):
    big = {f"t{i}": ShardedTensor(f"t{i}", torch.randn(300, 700), (300, 700), (0, 0))
           for i in range(5)}  # fmt: skip
    Checkpointer(tmp_path).save(1, big | pieces_for(0, 1), common={"a": 1},
                                rank_state={"rng": 5})  # fmt: skip
    directory = checkpoint_dir(tmp_path, 1)
    recorded = json.loads((directory / "checksums.json").read_text())
    data_files = sorted(p.name for p in directory.glob("*.distcp"))
    assert len(data_files) == 2  # two writer threads, two files
    assert set(data_files) <= set(recorded)
    assert {name: file_digest(directory / name) for name in recorded} == recorded


def test_the_hashing_writer_records_every_data_file(tmp_path):
    writer = HashingFileSystemWriter(tmp_path, thread_count=2)
    with single_process_quiet():
        dcp.save({"a": torch.randn(100, 100), "b": torch.arange(10)}, storage_writer=writer,
                 no_dist=True)  # fmt: skip
    files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert files and sorted(writer.digests) == files
    assert all(writer.digests[n] == file_digest(tmp_path / n) for n in files)


def test_a_corrupted_or_missing_file_is_named(tmp_path):
    Checkpointer(tmp_path).save(1, pieces_for(0, 1))
    directory = checkpoint_dir(tmp_path, 1)
    shard = next(directory.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupted, match=rf"{shard.name}: sha256 differs"):
        load_checkpoint(tmp_path, empty_like(pieces_for(0, 1)))
    shard.unlink()
    with pytest.raises(CheckpointCorrupted, match=rf"{shard.name}: missing"):
        load_checkpoint(tmp_path, empty_like(pieces_for(0, 1)))


def test_strict_and_non_strict_keys_and_shape_changes(tmp_path):
    Checkpointer(tmp_path).save(1, pieces_for(0, 1))
    asked = empty_like(pieces_for(0, 1))
    asked["extra"] = ShardedTensor("extra", torch.zeros(2), (2,), (0,))
    del asked["m"]
    with pytest.raises(KeyError, match=r"missing keys \['extra'\]; unexpected keys \['m'\]"):
        load_checkpoint(tmp_path, asked)
    loaded = load_checkpoint(tmp_path, asked, strict=False)
    assert loaded.missing == ["extra"] and loaded.unexpected == ["m"]
    torch.testing.assert_close(asked["w"].data, W, rtol=0, atol=0)
    wider = {"w": ShardedTensor("w", torch.zeros(8, 7), (8, 7), (0, 0))}
    with pytest.raises(ValueError, match=r"w: saved \(8, 6\), now \(8, 7\)"):
        load_checkpoint(tmp_path, wider, strict=False)


@pytest.mark.parametrize(
    ("mismatch", "raises", "logged"),
    [
        (("raise", "raise"), True, 0),  # Megatron's raise_all
        (("raise", "ignore"), True, 0),  # assume_ok_unexpected, raise_unexpected
        (("log", "ignore"), False, 1),  # log_unexpected
        (("log", "log"), False, 2),  # log_all
        (("ignore", "ignore"), False, 0),  # ignore_all
    ],
)
def test_mismatch_policies(tmp_path, caplog, mismatch, raises, logged):
    """mismatch=(an asked key not saved, a saved key not asked for): raise, log or ignore;
    a missing piece keeps its values, the rest loads."""
    Checkpointer(tmp_path).save(1, pieces_for(0, 1))
    asked = empty_like(pieces_for(0, 1))
    asked["extra"] = ShardedTensor("extra", torch.full((2,), 7.0), (2,), (0,))
    del asked["m"]
    if raises:
        with pytest.raises(KeyError, match=r"missing keys \['extra'\]"):
            load_checkpoint(tmp_path, asked, mismatch=mismatch)
        return
    with caplog.at_level("WARNING", logger="mp_ckpt.core.loader"):
        load_checkpoint(tmp_path, asked, mismatch=mismatch)
    messages = [r.getMessage() for r in caplog.records if r.name == "mp_ckpt.core.loader"]
    assert len(messages) == logged, messages
    assert all("extra" in m or "'m'" in m for m in messages)
    torch.testing.assert_close(asked["w"].data, W, rtol=0, atol=0)
    assert torch.equal(asked["extra"].data, torch.full((2,), 7.0))


def test_metadata_is_readable_json(tmp_path):
    Checkpointer(tmp_path).save(5, pieces_for(0, 1), layout={"tp": 1, "pp": 1})
    meta = json.loads((checkpoint_dir(tmp_path, 5) / "mp_metadata.json").read_text())
    assert meta["iteration"] == 5 and set(meta["tensors"]) == {"w", "m", "opt.m"}
    assert meta["tensors"]["opt.m"] == {"shape": [5, 6], "dtype": "float32"}


def test_finetune_loads_the_model_only_and_resets_the_iteration(tmp_path):
    Checkpointer(tmp_path).save(9, pieces_for(0, 1), rank_state={"rng": 1})
    model_only = {k: p for k, p in empty_like(pieces_for(0, 1)).items() if k != "opt.m"}
    with pytest.raises(KeyError, match=r"unexpected keys \['opt.m'\]"):
        load_checkpoint(tmp_path, model_only)
    renamed = {"w": model_only["w"], "m": model_only["m"]}
    Checkpointer(tmp_path / "b").save(9, {**pieces_for(0, 1), "optimizer.exp_avg.w": ShardedTensor(
        "optimizer.exp_avg.w", torch.ones(8, 6), (8, 6), (0, 0))})  # fmt: skip
    target = {**renamed, "opt.m": empty_like(pieces_for(0, 1))["opt.m"]}
    loaded = load_checkpoint(tmp_path / "b", target, finetune=True)
    assert loaded.iteration == 0 and loaded.rank_state is None and loaded.unexpected == []
    torch.testing.assert_close(target["w"].data, W, rtol=0, atol=0)
