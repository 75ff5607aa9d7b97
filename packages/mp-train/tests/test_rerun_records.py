"""The rerun engine's records: the tracker file's lines and the iterations it says to skip
(Megatron-LM's rule, either status spelling), the spike detector, the differences and
their summary."""

import math
import re

import pytest

from mp_train.loop.rerun_records import (
    SpikeDetector,
    Tracker,
    iterations_to_skip,
    relative_difference,
    summarize,
)


def line(job: str, rank: int, iteration: int, status: str) -> str:
    return (f"ts=2026-12-05 10:00:00.000001 node=n1 device=0 jobID={job} rank={rank} "
            f"iteration={iteration} status={status} result=nan message='nan loss'\n")  # fmt: skip


def test_a_tracker_line_is_megatrons_and_reads_back(tmp_path):
    path = tmp_path / "rejected.txt"
    tracker = Tracker(str(path), rank=3, device="cuda:0")
    tracker.write(7, "rerun_disabled", float("nan"), "nan loss")
    tracker.write(7, "rerun_disabled", float("nan"), "nan loss")
    written = path.read_text().splitlines()
    assert len(written) == 2
    pattern = (
        r"ts=\S+ \S+ node=\S+ device=cuda:0 jobID=\S+ rank=3 iteration=7 "
        r"status=rerun_disabled result=nan message='nan loss'"
    )
    assert re.fullmatch(pattern, written[0])
    assert iterations_to_skip(str(path)) == [7]  # the same rank twice


def test_no_tracker_file_writes_nothing(tmp_path):
    Tracker(None, rank=0, device="cpu").write(1, "initial_run", 1.0, "nan loss")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_tracker_file_is_named(tmp_path):
    with pytest.raises(OSError, match=r"result_rejected_tracker_filename=.*missing.*cannot"):
        Tracker(str(tmp_path / "missing" / "rejected.txt"), rank=0, device="cpu")


def test_which_iterations_are_skipped(tmp_path):
    path = tmp_path / "rejected.txt"
    path.write_text("".join([
        line("1", 0, 5, "rerun_disabled"), line("2", 0, 5, "rerun_disabled"),  # twice: skip
        line("1", 0, 6, "initial_run"), line("2", 0, 6, "initial_run"),  # never rerun: keep
        line("1", 1, 8, "first_rerun_reproducible"),
        line("2", 1, 8, "RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE"),  # skip
        line("1", 0, 9, "first_rerun_not_reproducible"),
        line("2", 0, 9, "first_rerun_not_reproducible"),  # transient: keep
        line("1", 0, 11, "rerun_disabled"), line("1", 1, 11, "rerun_disabled"),
        line("2", 0, 11, "rerun_disabled"),  # several ranks of one job: keep
        "a line of something else\n",
    ]))  # fmt: skip
    assert iterations_to_skip(str(path)) == [5, 8]
    assert iterations_to_skip(str(tmp_path / "absent.txt")) == []


def test_a_spike_is_ten_times_the_largest_of_the_first_losses():
    spikes = SpikeDetector(factor=10.0, samples=3)
    assert not any(spikes.is_spike(v) for v in (2.0, -4.0, 3.0))  # the reference: 4
    assert not spikes.is_spike(39.0)
    assert spikes.is_spike(-40.0)
    assert not spikes.is_spike(math.nan) and not spikes.is_spike(math.inf)
    again = SpikeDetector(factor=10.0, samples=3)
    again.load_state_dict(spikes.state_dict())
    assert again.is_spike(40.0) and not again.is_spike(39.0)


def test_relative_differences_and_their_summary():
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(math.nan, math.nan) == 0.0
    assert relative_difference(math.inf, math.inf) == 0.0
    assert relative_difference(1.0, math.nan) == math.inf
    assert relative_difference(math.nan, math.inf) == math.inf
    assert relative_difference(3.0, 1.0) == pytest.approx(1.0)
    assert summarize([0.0, 0.0]) == "2 compared, all identical"
    text = summarize([0.0, 0.0, 1e-3, 2e-3])
    assert text.startswith("4 compared, 2 identical; relative difference mean 7.500e-04")
    assert text.endswith("max 2.000e-03")
