"""ShardedTensor and check_tiling."""

import pytest
import torch

from mp_ckpt import ShardedTensor, check_tiling


def test_pieces_of_a_split_axis_tile_the_tensor():
    full = torch.arange(24.0).reshape(4, 6)
    pieces = [
        ShardedTensor.from_rank("w", chunk, axis=1, rank=r, num_shards=3)
        for r, chunk in enumerate(full.chunk(3, dim=1))
    ]
    assert check_tiling(pieces) == {"w": (4, 6)}
    for p in pieces:
        assert torch.equal(full[p.global_slices], p.data)


def test_replicas_do_not_count_twice():
    norm = torch.ones(8)
    pieces = [ShardedTensor.from_rank("norm", norm, None, 0, 1, replica_id=r) for r in range(4)]
    assert check_tiling(pieces) == {"norm": (8,)}


def test_fused_parts_are_strided_views_of_one_parameter():
    # A GQA-style fused weight: per group, 2 query heads then k then v (head dim 3, hidden 5).
    groups, per_group, head_dim, hidden = 2, 2, 3, 5
    fused = torch.randn(groups * (per_group + 2) * head_dim, hidden)
    view = fused.view(groups, per_group + 2, head_dim, hidden)
    q = ShardedTensor("q", view[:, :per_group], (groups, per_group, head_dim, hidden), (0, 0, 0, 0))
    k = ShardedTensor("k", view[:, per_group], (groups, head_dim, hidden), (0, 0, 0))
    check_tiling([q, k])
    q.data.zero_()  # loading into the part writes into the fused parameter
    assert fused.view(groups, per_group + 2, head_dim, hidden)[:, :per_group].abs().sum() == 0


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([ShardedTensor("w", torch.zeros(2, 3), (4, 3), (0, 0))], r"w: saved pieces cover 6 of 12"),
        (
            [ShardedTensor("w", torch.zeros(2, 3), (3, 3), (0, 0)),
             ShardedTensor("w", torch.zeros(2, 3), (3, 3), (1, 0))],
            r"w: saved pieces at \(0, 0\) and \(1, 0\) overlap",
        ),
        (
            [ShardedTensor("w", torch.zeros(2), (2,), (0,)),
             ShardedTensor("w", torch.zeros(2), (4,), (2,))],
            "w: pieces disagree on the global shape",
        ),
    ],
)  # fmt: skip
def test_gaps_overlaps_and_shape_disagreements_are_errors(pieces, message):
    with pytest.raises(ValueError, match=message):
        check_tiling(pieces)


def test_a_piece_outside_its_global_tensor_is_an_error():
    with pytest.raises(ValueError, match=r"w: on axis 0 the piece covers 3\.\.5, outside .* 4"):
        ShardedTensor("w", torch.zeros(2, 2), (4, 2), (3, 0))
    with pytest.raises(ValueError, match="same number of axes"):
        ShardedTensor("w", torch.zeros(2, 2), (4,), (0,))
