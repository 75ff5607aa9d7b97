"""CheckpointReader reads a logical tensor, or a region of it, from the chunks that
cover it, parsing DCP's .metadata once for all its reads."""

import torch

from mp_ckpt import Checkpointer, CheckpointReader, Region, ShardedTensor
from mp_ckpt.core.box_reads import KeptMetadataReader

W = torch.arange(48.0).view(8, 6)
M = torch.arange(30.0).view(5, 6) / 7


def _saved(root) -> None:
    """w in four row chunks, m in two flat ranges (as an optimizer state is saved)."""
    pieces = {f"w{i}": ShardedTensor("w", W[2 * i : 2 * i + 2].clone(), (8, 6), (2 * i, 0))
              for i in range(4)}  # fmt: skip
    for i, (s, e) in enumerate(((0, 13), (13, 30))):
        pieces[f"m{i}"] = ShardedTensor("m", M.reshape(-1)[s:e].clone(), (5, 6), (0, 0), 0,
                                        (s, e), (5, 6))  # fmt: skip
    Checkpointer(root).save(1, pieces, common={}, rank_state={})


def test_whole_tensors_and_regions_read_with_one_parse(tmp_path, monkeypatch):
    _saved(tmp_path)
    parses = []
    parse = KeptMetadataReader.parse_metadata
    monkeypatch.setattr(KeptMetadataReader, "parse_metadata",
                        lambda self, path: parses.append(path) or parse(self, path))  # fmt: skip
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.read("w"), W)
    assert torch.equal(reader.read("w", Region((1, 2), (5, 3))), W[1:6, 2:5])
    assert torch.equal(reader.read("m"), M)
    assert torch.equal(reader.read("w"), W)  # the same reader again: nothing stale
    assert len(parses) == 1, parses
