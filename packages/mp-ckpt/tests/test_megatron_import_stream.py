"""import-megatron reads one tensor at a time: read_megatron's tensors say their shapes
without reading them, a hostile file is refused with mmap as without, and every
logical tensor of logical_plan has the shape and dtype it announced."""

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
