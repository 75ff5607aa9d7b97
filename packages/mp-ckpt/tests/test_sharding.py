"""ShardedTensor and check_tiling."""

import pytest
import torch

from mp_ckpt import ShardedTensor, assemble, check_tiling


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


def flattened_pieces(whole: torch.Tensor, ranges) -> list[ShardedTensor]:
    """whole [4, 6] split along axis 1 over 2 "TP ranks", each box cut into flat ranges."""
    pieces = []
    for tp in range(2):
        box = whole[:, 3 * tp : 3 * tp + 3]
        for start, end in ranges:
            data = box.reshape(-1)[start:end].clone()
            pieces.append(ShardedTensor("w", data, (4, 6), (0, 3 * tp), 0, (start, end), (4, 3)))
    return pieces


def test_flattened_ranges_assemble_and_read_back():
    whole = torch.arange(24.0).view(4, 6)
    pieces = flattened_pieces(whole, [(0, 5), (5, 12)])
    assert check_tiling(pieces) == {"w": (4, 6)}
    torch.testing.assert_close(assemble(pieces)["w"], whole, rtol=0, atol=0)
    for piece in pieces:
        torch.testing.assert_close(piece.read_from(whole), piece.data, rtol=0, atol=0)


def test_flattened_ranges_gap_and_overlap_are_errors():
    whole = torch.arange(24.0).view(4, 6)
    with pytest.raises(ValueError, match="cover 22 of 24"):
        check_tiling(flattened_pieces(whole, [(0, 5), (6, 12)]))
    with pytest.raises(ValueError, match="overlap"):
        check_tiling(flattened_pieces(whole, [(0, 6), (5, 12)]))


def test_flattened_range_validation():
    with pytest.raises(ValueError, match="needs the box's local_shape"):
        ShardedTensor("w", torch.zeros(3), (4,), (0,), 0, (0, 3))
    with pytest.raises(ValueError, match=r"flattened_range \(2, 9\) must lie in 0 .. 8"):
        ShardedTensor("w", torch.zeros(7), (2, 4), (0, 0), 0, (2, 9), (2, 4))
    with pytest.raises(ValueError, match="must be 1-D of 3 elements"):
        ShardedTensor("w", torch.zeros(2, 2), (2, 4), (0, 0), 0, (0, 3), (2, 4))
