"""copy_shared: any saved tiling (boxes, flattened ranges) fills any target tiling."""

import itertools

import pytest
import torch

from mp_ckpt import ShardedTensor
from mp_ckpt.core.regions import Region, copy_shared

GLOBAL = torch.arange(60.0).view(6, 10)


def tiling(splits0, splits1, flat_parts):
    """Boxes from the split points on each axis, each box cut into flat_parts ranges."""
    pieces = []
    for (a0, a1), (b0, b1) in itertools.product(
        itertools.pairwise(splits0), itertools.pairwise(splits1)
    ):
        box = GLOBAL[a0:a1, b0:b1]
        n = box.numel()
        cuts = [n * i // flat_parts for i in range(flat_parts + 1)]
        for s, e in itertools.pairwise(cuts):
            if s == e:
                continue
            if flat_parts == 1:
                pieces.append(ShardedTensor("g", box.clone(), (6, 10), (a0, b0)))
            else:
                pieces.append(
                    ShardedTensor(
                        "g",
                        box.reshape(-1)[s:e].clone(),
                        (6, 10),
                        (a0, b0),
                        0,
                        (s, e),
                        tuple(box.shape),
                    )
                )
    return pieces


def region(p):
    return Region(p.global_offset, p.shape, p.flattened_range)


LAYOUTS = {
    "rows2": ([0, 3, 6], [0, 10], 1),
    "cols5": ([0, 6], [0, 2, 4, 6, 8, 10], 1),
    "rows2-flat3": ([0, 3, 6], [0, 10], 3),
    "grid-flat2": ([0, 2, 6], [0, 7, 10], 2),
    "whole-flat4": ([0, 6], [0, 10], 4),
}


@pytest.mark.parametrize("saved,target", list(itertools.permutations(LAYOUTS, 2)))
def test_any_tiling_fills_any_other(saved, target):
    sources = tiling(*LAYOUTS[saved])
    for want in tiling(*LAYOUTS[target]):
        got = torch.full_like(want.data, float("nan"))
        copied = sum(copy_shared(s.data, region(s), got, region(want)) for s in sources)
        assert copied == want.numel
        torch.testing.assert_close(got, want.data, rtol=0, atol=0)


def test_disjoint_regions_copy_nothing():
    a = Region((0, 0), (2, 2))
    b = Region((2, 0), (2, 2))
    assert copy_shared(torch.ones(2, 2), a, torch.zeros(2, 2), b) == 0
    flat = Region((0, 0), (2, 2), (0, 2))
    other = Region((0, 0), (2, 2), (2, 4))
    assert copy_shared(torch.ones(2), flat, torch.zeros(2), other) == 0
