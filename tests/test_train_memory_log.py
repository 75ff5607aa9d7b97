"""--log-memory-interval (Megatron's): the memory report, which comes after the first
log_interval iterations, comes again every N iterations; N must be a multiple of
log_interval."""

import pytest

from mp_gpt.testing import tiny_options, train_printed_on_rank
from mp_state.testing import run_on_ranks
from mp_train import parse_config


def memory_lines(argv: list[str]) -> list[str]:
    printed = train_printed_on_rank(argv)
    return [line.split(":")[0] for line in printed.splitlines() if line.startswith("memory")]


@pytest.mark.multirank
def test_the_memory_report_every_n_iterations(tmp_path):
    flags = ["--log-interval", "1", "--log-memory-interval", "2", "--train-iters", "5"]
    (lines,) = run_on_ranks(memory_lines, 1, tiny_options(tmp_path, *flags), timeout=120)
    assert lines == [f"memory after {i} iterations" for i in (1, 2, 4)]


def test_the_interval_must_fit_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("MP_RUN_DIR", str(tmp_path))
    for flags, message in (
        (["--log-interval", "2", "--log-memory-interval", "3"], "a multiple of log_interval=2"),
        (["--log-memory-interval", "10", "--no-log-memory"], "it needs log_memory"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_config(tiny_options(tmp_path, *flags))
