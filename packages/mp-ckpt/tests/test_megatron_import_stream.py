"""import-megatron reads one tensor at a time: read_megatron's tensors say their shapes
without reading them, a hostile file is refused with mmap as without, and every
logical tensor of logical_plan has the shape and dtype it announced."""

import collections
import os
from pathlib import Path

import pytest
import torch

from mp_ckpt import MegatronTensors, UnsafePickleError, read_megatron, safe_load
from mp_ckpt.megatron.importer import logical_from_megatron, logical_plan

ASSETS = Path(__file__).parent / "assets" / "megatron"
CASES = ["llama_torch_dist_tp1", "llama_torch_dist_tp2_distopt", "llama_torch_tp2",
         "gpt2_torch_dist_tp1", "llama_torch_pp2"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_tensors_are_read_when_looked_up_with_the_announced_shapes(case):
    model = read_megatron(ASSETS / case)
    assert isinstance(model.tensors, MegatronTensors)
    for name in model.tensors:
        tensor = model.tensors[name]
        assert tuple(tensor.shape) == model.tensors.shape(name), name
        assert tensor.dtype == model.tensors.dtype(name), name
        assert tensor.is_contiguous(), name
    plan, settings = logical_plan(model)
    whole, whole_settings = logical_from_megatron(model)
    assert settings == whole_settings and list(plan) == list(whole)
    for key, (shape, dtype, produce) in plan.items():
        tensor = produce()
        assert (tuple(tensor.shape), tensor.dtype) == (shape, dtype), key
        assert torch.equal(tensor, whole[key]), key


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_mapped_file_passes_the_allow_list_too(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": None, "model": _Hostile(marker)}, path)
    with pytest.raises(UnsafePickleError, match=r"refused global (os|posix)\.system"):
        safe_load(path, mmap=True)
    assert not marker.exists()
    torch.save({"w": torch.arange(4.0)}, path)
    assert torch.equal(safe_load(path, mmap=True)["w"], torch.arange(4.0))


@pytest.mark.parametrize("case", ["llama_torch_dist_tp2_distopt", "llama_torch_pp2"])
def test_each_file_is_parsed_once_for_all_its_tensors(case, monkeypatch):
    """torch_dist: the .metadata pickle once for every tensor read; legacy: each rank
    file's pickle once for the tensors of its pipeline stage, read one after another.
    (ci/bench/bench_megatron_import.py checks that the memory stays near the largest
    tensor all the same.)"""
    from mp_ckpt.megatron import read

    parsed = []  # the files unpickled (a pickle held in memory is not one)

    def load(source, *args, **kwargs):
        if not isinstance(source, bytes):
            parsed.append(source)
        return safe_load(source, *args, **kwargs)

    monkeypatch.setattr(read, "safe_load", load)
    parse = read._SafeReader.parse_metadata
    monkeypatch.setattr(read._SafeReader, "parse_metadata",
                        lambda self, path: parsed.append(path) or parse(self, path))  # fmt: skip
    given_back = []  # the pages given back to the mapped files (Linux)
    if read._MADVISE is not None:
        madvise = read._MADVISE
        monkeypatch.setattr(read, "_MADVISE", lambda *a: given_back.append(a) or madvise(*a))
    model = read_megatron(ASSETS / case)
    opened = len(parsed)
    tensors = [model.tensors[name] for name in model.tensors]
    during_reads = collections.Counter(Path(p).name for p in parsed[opened:])
    if case.startswith("llama_torch_dist"):
        assert parsed == [ASSETS / case / "iter_0000002" / ".metadata"] and not during_reads
    else:  # two stages, a file each
        assert during_reads == {"model_optim_rng.pt": 2}, parsed[opened:]
        if read._MADVISE is not None:  # one piece per tensor (TP 1), each given back
            assert len(given_back) == len(model.tensors)
    assert len(tensors) > 10
    # Legacy: the pages each read came from were given back; read again from the file,
    # they hold the same values.
    for name, tensor in zip(model.tensors, tensors, strict=True):
        assert torch.equal(model.tensors[name], tensor), name
