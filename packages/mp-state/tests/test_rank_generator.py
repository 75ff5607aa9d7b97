"""RankGenerator: Megatron's classic layouts by hand, and an independent grid oracle."""

import itertools
import random

import numpy as np
import pytest

from mp_state import RankGenerator

AXES = ["tp", "cp", "ep", "dp", "pp"]


def test_megatron_example_tp2_pp2_dp2_on_8_ranks_default_order():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert gen.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert gen.get_ranks("tp-dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gen.get_ranks("cp") == [[r] for r in range(8)]
    assert gen.get_ranks("dp-cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_megatron_example_tp2_pp4_dp2_on_16_ranks_order_tp_dp_pp():
    # The example of megatron-core's initialize_model_parallel docstring.
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-dp-pp")
    assert gen.get_ranks("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert gen.get_ranks("tp") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert gen.get_ranks("pp") == [
        [0, 4, 8, 12],
        [1, 5, 9, 13],
        [2, 6, 10, 14],
        [3, 7, 11, 15],
    ]
    assert gen.get_ranks("tp-pp") == [
        [0, 1, 4, 5, 8, 9, 12, 13],
        [2, 3, 6, 7, 10, 11, 14, 15],
    ]


def test_pp_first_order_puts_pipeline_neighbours_next_to_each_other():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="pp-tp-dp")
    assert gen.get_ranks("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen.get_ranks("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_offset_shifts_every_rank():
    gen = RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-dp", rank_offset=4)
    assert gen.get_ranks("tp") == [[4, 5]]


def grid_oracle(sizes: dict[str, int], order: list[str], token: str) -> list[list[int]]:
    """The same groups from a numpy grid: axis i of the grid is order[-1 - i]."""
    world = np.arange(int(np.prod([sizes[a] for a in order]))).reshape(
        [sizes[a] for a in reversed(order)]
    )
    wanted = token.split("-")
    fixed = [a for a in reversed(order) if a not in wanted]
    varying = [a for a in reversed(order) if a in wanted]
    perm = [list(reversed(order)).index(a) for a in fixed + varying]
    group_size = int(np.prod([sizes[a] for a in varying]))
    return world.transpose(perm).reshape(-1, group_size).tolist()


def test_every_order_and_token_matches_the_grid_oracle():
    rng = random.Random(1234)
    checked = 0
    for perm in itertools.permutations(AXES):
        for _ in range(4):
            sizes = {a: rng.choice([1, 2, 3]) for a in AXES}
            if sizes["ep"] > 1 and sizes["cp"] > 1:
                sizes[rng.choice(["ep", "cp"])] = 1
            order = "-".join(perm)
            gen = RankGenerator(**sizes, order=order)
            for k in range(1, 6):
                for token in itertools.combinations(AXES, k):
                    for t in (token, token[::-1]):
                        expected = grid_oracle(sizes, list(perm), "-".join(t))
                        assert gen.get_ranks("-".join(t)) == expected, (sizes, order, t)
                        checked += 1
    assert checked == 120 * 4 * 62


def test_axes_of_size_one_left_out_of_the_order_are_appended():
    short = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    full = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp-cp-ep-pp")
    assert short.order == "tp-dp-cp-ep-pp"
    for token in ["tp", "dp", "pp", "cp", "ep", "tp-dp", "tp-pp", "dp-cp"]:
        assert short.get_ranks(token) == full.get_ranks(token)


def test_groups_list_ranks_in_ascending_order():
    # torch numbers a group's members by ascending global rank; ours must agree.
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=2, cp=2, order="dp-pp-tp-cp")
    for k in range(1, 6):
        for token in itertools.combinations(AXES, k):
            for group in gen.get_ranks("-".join(token)):
                assert group == sorted(group)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=2, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp"), "ep=2 and cp=2"),
        (dict(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-xp-dp"), "unknown token"),
        (dict(tp=2, ep=1, dp=1, pp=1, cp=1, order="tp-dp-tp"), "repeats token"),
        (dict(tp=1, ep=1, dp=2, pp=4, cp=1, order="tp-dp"), "leaves out pp=4"),
        (dict(tp=0, ep=1, dp=1, pp=1, cp=1, order="tp-dp"), "tp=0"),
        (dict(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-dp", rank_offset=-1), "rank_offset=-1"),
    ],
)
def test_invalid_generators_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RankGenerator(**kwargs)


def test_token_outside_the_axes_is_an_error():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp")
    with pytest.raises(ValueError, match="'xp'"):
        gen.get_ranks("tp-xp")
