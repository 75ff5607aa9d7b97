"""--log-straggler names the slow rank: a two-rank run whose rank 0 sleeps in each of its
forward steps (the test's own wrapper around mp_gpt's forward step) prints, on the last
rank, every log interval, a line naming rank 0 as the slowest with its time; without
the flag there is no such line.
"""

import os
import re
import time

import pytest

from mp_gpt.testing import tiny_options, train_printed_on_rank
from mp_state.testing import run_on_ranks
from mp_train.observability.stragglers import straggler_line

SLEEP_S = 0.05
MICROBATCHES = 2  # global batch 4 in micro-batches of 1 over two data-parallel ranks


def slowed_on_rank_0(argv: list[str]) -> str:
    """train_printed_on_rank, rank 0's forward steps SLEEP_S slower."""
    import mp_gpt.pretrain

    if os.environ["RANK"] == "0":
        forward_step = mp_gpt.pretrain.forward_step

        def slow_forward_step(*args, **kwargs):
            time.sleep(SLEEP_S)
            return forward_step(*args, **kwargs)

        mp_gpt.pretrain.forward_step = slow_forward_step
    return train_printed_on_rank(argv)


LINE = re.compile(
    r"stragglers \| forward-step ms per iteration across 2 ranks: min ([\d.]+) \| "
    r"median ([\d.]+) \| max ([\d.]+) \| slowest rank (\d) ([\d.]+) \| fastest rank (\d) ([\d.]+)"
)


@pytest.mark.multirank
def test_the_slow_rank_is_named(tmp_path):
    argv = tiny_options(tmp_path, "--train-iters", "4", "--log-interval", "2", "--log-straggler")
    printed = run_on_ranks(slowed_on_rank_0, 2, argv, timeout=180)[1]  # the last rank prints
    lines = [LINE.search(line) for line in printed.splitlines() if "stragglers" in line]
    assert len(lines) == 2 and all(lines), printed  # iterations 2 and 4
    for found in lines:
        low, median, high, slowest, slow_ms, fastest, fast_ms = found.groups()
        assert (slowest, fastest) == ("0", "1"), found.group(0)
        assert float(slow_ms) == float(high) >= 1000 * SLEEP_S * MICROBATCHES
        assert float(fast_ms) == float(low) < float(high) - 1000 * SLEEP_S
        assert float(median) == pytest.approx((float(low) + float(high)) / 2, abs=0.1)


@pytest.mark.multirank
def test_no_line_without_the_flag(tmp_path):
    argv = tiny_options(tmp_path, "--train-iters", "2", "--log-interval", "2")
    printed = run_on_ranks(train_printed_on_rank, 2, argv, timeout=180)[1]
    assert "iteration        2" in printed and "stragglers" not in printed


def test_the_line_names_the_count_slowest_and_fastest():
    line = straggler_line([10.0, 40.0, 12.0, 30.0], count=2)
    assert line == (
        "stragglers | forward-step ms per iteration across 4 ranks: min 10.0 | median 21.0 | "
        "max 40.0 | slowest rank 1 40.0, rank 3 30.0 | fastest rank 0 10.0, rank 2 12.0"
    )
