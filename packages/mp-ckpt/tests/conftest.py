"""What several of mp-ckpt's Megatron-LM test files check alike, as fixtures."""

from pathlib import Path

import pytest
import torch

from mp_ckpt import CheckpointReader, import_megatron, safe_load
from mp_ckpt.megatron.write import export_megatron


@pytest.fixture
def legacy_export_is_megatrons(tmp_path):
    """check(fixture): a legacy-format (torch) megatron-core fixture saved at TP2, imported
    and exported again at TP2, equals megatron-core's own files, tensor for tensor and key
    for key; exported at TP1, it imports back to the same tensors."""

    def check(fixture: Path) -> None:
        import_megatron(fixture, tmp_path / "mp")
        out = export_megatron(tmp_path / "mp", tmp_path / "meg", ckpt_format="torch",
                              tensor_model_parallel_size=2)  # fmt: skip
        for rank in range(2):
            folder = f"mp_rank_{rank:02d}"
            ours = safe_load(out / folder / "model_optim_rng.pt")["model"]
            theirs = safe_load(fixture / "iter_0000002" / folder / "model_optim_rng.pt")["model"]
            assert ours.keys() == theirs.keys()
            for key, value in theirs.items():
                assert value is None or torch.equal(ours[key], value), (folder, key)
        export_megatron(tmp_path / "mp", tmp_path / "tp1", ckpt_format="torch")
        import_megatron(tmp_path / "tp1", tmp_path / "back")
        before, after = _tensors(tmp_path / "mp"), _tensors(tmp_path / "back")
        assert before.keys() == after.keys()
        assert all(torch.equal(after[k], t) for k, t in before.items())

    return check


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root)
    return {k: reader.read(k) for k in reader.keys}
