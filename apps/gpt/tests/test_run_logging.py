"""pretrain_gpt shows mp's Python log records (rank 0's info lines by default) and
--logging-level hides them; an MFU above 1 is not printed.

Each run is main() on a forked rank (mp_state.testing), its stdout and stderr read
together (mp_gpt.testing.train_output_on_rank)."""

from __future__ import annotations

import re

import pytest

from mp_gpt.config_files import config_path
from mp_gpt.testing import train_output_on_rank
from mp_state.testing import run_on_ranks

OPTIONS = [
    "--config", str(config_path("tiny.yaml")), "--mock-data", "--skip-train",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seq-length", "64",
    "--train-iters", "100", "--eval-interval", "none", "--save", "none", "--load", "none",
    "--tensorboard-dir", "none", "--num-workers", "0",
]  # fmt: skip
INFO = "[rank 0] INFO mp_train: torch.distributed initialized: world size 1, backend gloo"


def _run(*extra: str, options: list[str] = OPTIONS) -> str:
    [(status, out)] = run_on_ranks(train_output_on_rank, 1, [*options, *extra], timeout=180)
    assert status == 0, out
    return out


@pytest.mark.multirank
def test_info_lines_show_and_the_level_hides_them():
    assert INFO not in _run("--logging-level", "WARNING")
    # The default level, in a run of 2 iterations given a peak below what it achieves
    # (--peak-tflops 1e-9, as a reference measured on a busy machine could be): one line
    # says why the MFU is not shown, and no log line has it.
    training = [o for o in OPTIONS if o != "--skip-train"]
    out = _run("--peak-tflops", "1e-9", "--train-iters", "2", "--log-interval", "1",
               "--micro-batch-size", "1", "--global-batch-size", "1", "--lr-warmup-iters", "0",
               options=training)  # fmt: skip
    assert INFO in out
    assert out.count("MFU not shown:") == 1, out
    assert "give the device's peak with --peak-tflops" in out
    lines = [line for line in out.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 2 and not any("MFU" in line for line in lines), out


@pytest.mark.multirank
def test_the_start_up_timers_are_printed_once_across_ranks():
    # Megatron's two start-up timers, min and max over the ranks, on the last rank only.
    outs = run_on_ranks(train_output_on_rank, 2, OPTIONS, timeout=180)
    assert [status for status, _ in outs] == [0, 0], outs
    found = [
        [line for line in out.splitlines() if line.startswith("time (ms) | ")] for _, out in outs
    ]
    assert found[0] == [] and len(found[1]) == 1, outs
    minmax = r"\(([\d.]+), ([\d.]+)\)"
    pattern = re.compile(rf"time \(ms\) \| model-and-optimizer-setup: {minmax} \| "
                         rf"train/valid/test-data-iterators-setup: {minmax}$")  # fmt: skip
    low, high, data_low, data_high = map(float, pattern.match(found[1][0]).groups())
    assert 0 < low <= high and 0 <= data_low <= data_high
