"""ShardedSafetensorsWriter: files safetensors reads back, sharded by size, atomic."""

import json

import pytest
import torch
from safetensors.torch import load_file

from mp_ckpt.hf.safetensors_writer import ShardedSafetensorsWriter


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(30, 20, generator=g),
        "b.weight": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.half": torch.randn(5, generator=g).half(),
        "e.flag": torch.tensor([True, False, True]),
        "f.t": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "g.empty": torch.zeros(0, 3),
    }


def test_one_file_reads_back(tmp_path):
    with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1 << 30) as writer:
        for name, t in tensors().items():
            writer.add(name, t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    for name, t in tensors().items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_shards_by_size_with_an_index_replacing_an_earlier_export(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"an earlier export")
    with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000) as writer:
        for name, t in tensors().items():
            writer.add(name, t)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"
    assert index["weight_map"]["a.weight"] == files[0]  # 2,400 bytes: a shard of its own
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*files, "model.safetensors.index.json"])  # fmt: skip
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors().values())  # fmt: skip
    for name, t in tensors().items():
        assert torch.equal(load_file(str(tmp_path / index["weight_map"][name]))[name], t), name


def test_a_failure_leaves_the_earlier_files_and_no_temporaries(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"an earlier export")
    with (
        pytest.raises(RuntimeError, match="reading failed"),
        ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000) as writer,
    ):
        writer.add("a.weight", torch.ones(300))
        raise RuntimeError("reading failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"an earlier export"


def test_bad_input_is_named(tmp_path):
    with ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000) as writer:
        writer.add("a", torch.ones(2))
        with pytest.raises(ValueError, match="a is written twice"):
            writer.add("a", torch.ones(2))
        with pytest.raises(TypeError, match=r"b: safetensors has no dtype for torch\.complex64"):
            writer.add("b", torch.ones(2, dtype=torch.complex64))
