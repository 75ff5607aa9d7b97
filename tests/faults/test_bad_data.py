"""Damaged data files stop the run at start with an error naming the file: a truncated
.idx or .bin (every rank reads them and says so), a truncated index cache (the document,
sample and shuffle indices mp-data builds once per dataset and then reads).

Two forked ranks (gloo) run apps/gpt's pretrain, the tiny config, on a small corpus
written here.
"""

from pathlib import Path

import numpy as np
import pytest

from mp_data import IndexedDatasetBuilder
from mp_gpt.testing import tiny_options, train_on_rank
from mp_state.testing import RankFailure, run_on_ranks


def write_corpus(prefix: Path) -> None:
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(200):
        builder.add_item(np.append(rng.integers(2, 1000, rng.integers(10, 120)), 0))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def options(run_dir: Path) -> list[str]:
    real_data = [o for o in tiny_options(run_dir) if o != "--mock-data"]
    return [*real_data, "--data-path", str(run_dir / "corpus"), "--split", "98,2,0",
            "--data-cache-path", str(run_dir / "cache"), "--eval-interval", "2",
            "--eval-iters", "1"]  # fmt: skip


def cut(path: Path, keep: int) -> None:
    with path.open("r+b") as f:
        f.truncate(keep)


def failure_of(run_dir: Path) -> dict[int, str]:
    with pytest.raises(RankFailure) as raised:
        run_on_ranks(train_on_rank, 2, options(run_dir), timeout=180)
    return raised.value.failures


@pytest.mark.multirank
@pytest.mark.parametrize("damaged", [".idx", ".bin"])
def test_a_truncated_data_file_is_named_at_start(tmp_path, damaged):
    write_corpus(tmp_path / "corpus")
    path = tmp_path / f"corpus{damaged}"
    cut(path, path.stat().st_size // 2)
    failures = failure_of(tmp_path)
    assert sorted(failures) == [0, 1], failures
    for report in failures.values():
        assert str(path) in report and "truncated" in report, report


@pytest.mark.multirank
def test_a_truncated_index_cache_is_named(tmp_path):
    write_corpus(tmp_path / "corpus")
    # A first run builds the caches and trains.
    assert run_on_ranks(train_on_rank, 2, options(tmp_path), timeout=180) == [0, 0]
    caches = sorted((tmp_path / "cache").rglob("*.npy"))
    assert caches, list((tmp_path / "cache").rglob("*"))
    victim = max(caches, key=lambda p: p.stat().st_size)
    cut(victim, victim.stat().st_size // 2)
    # Rank 0 reads the caches first (the others wait for it at a barrier, then see it
    # gone): its error names the file and the remedy.
    report = failure_of(tmp_path)[0]
    assert f"{victim}: the index cache entry is damaged" in report, report
    assert "delete its files" in report
