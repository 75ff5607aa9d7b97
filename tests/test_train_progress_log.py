"""--log-progress (Megatron's progress.txt, observability/progress_log.py) through the real
loop: a job's start, each save with its throughputs, operations and tokens, the
deletions of --ckpt-keep-last and, with --async-save, the staging and the commit; a
resumed job adds its own start and counts its cumulative throughput from the first."""

import pytest

from mp_gpt.testing import tiny_options, train_on_rank
from mp_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def events(path) -> list[tuple[str, ...]]:
    """Each line's event and iteration (fields 3 and 4), after checking Megatron's layout."""
    rows = []
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        assert fields[1].startswith("Job ID: ") and fields[2] == "# GPUs: 2", line
        if fields[3] in ("Saved checkpoint", "Saving async checkpoint"):
            names = [f.split(": ")[0] for f in fields[4:]]
            assert names == [
                "Iteration",
                "Job throughput",
                "Cumulative throughput",
                "Floating-point operations",
                "Tokens (in billions)",
            ], line
            assert float(fields[7].split(": ")[1]) > 0, line
        rows.append(tuple(fields[3:5]))
    return rows


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_progress_log_records_starts_saves_and_deletions(tmp_path, async_save):
    ckpt = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--save-interval",
            "2", "--ckpt-keep-last", "1", "--log-progress",
            *(["--async-save"] if async_save else [])]  # fmt: skip
    first = tiny_options(tmp_path / "a", *ckpt, "--train-iters", "6", "--exit-interval", "4")
    run_on_ranks(train_on_rank, 2, first, timeout=300)
    run_on_ranks(train_on_rank, 2, tiny_options(tmp_path / "b", *ckpt, "--train-iters", "6"),
                 timeout=300)  # fmt: skip
    saved = "Saving async checkpoint" if async_save else "Saved checkpoint"

    def save(i: int) -> list[tuple[str, ...]]:
        rows = [(saved, f"Iteration: {i}")]
        deleted = [("Deleted checkpoint", f"Iteration: {i - 2}")] if i > 2 else []
        if async_save:  # its commit, with the deletion, comes after
            return rows + deleted + [("Saved async checkpoint", f"Iteration: {i}")]
        return deleted + rows  # the deletion is part of the save

    want = [("Starting job",), *save(2), *save(4), ("Starting job",), *save(6)]
    got = events(tmp_path / "ck" / "progress.txt")
    if not async_save:
        assert got == want
        return
    # An asynchronous save commits when its write has finished: on a loaded machine after
    # the next save has started. The same events, each commit after its own start, each
    # deletion after the save that replaces the deleted one.
    assert sorted(got) == sorted(want)
    for i in (2, 4, 6):
        assert got.index((saved, f"Iteration: {i}")) < got.index(
            ("Saved async checkpoint", f"Iteration: {i}"))  # fmt: skip
    for i in (2, 4):
        assert got.index((saved, f"Iteration: {i + 2}")) < got.index(
            ("Deleted checkpoint", f"Iteration: {i}"))  # fmt: skip
    starts = [k for k, row in enumerate(got) if row == ("Starting job",)]
    assert starts[0] == 0 and got.index(("Saved async checkpoint", "Iteration: 4")) < starts[1]
