"""What the rerun engine (rerun.py) keeps and writes beside the run: the rejected-results
tracker file (Megatron-LM's line format, so that either reads the other's), the
iterations it says to skip, the spike detector and the determinism statistics."""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
from collections import defaultdict

__all__ = [
    "SpikeDetector",
    "Tracker",
    "iterations_to_skip",
    "relative_difference",
    "summarize",
]

log = logging.getLogger("mp_train")

# A verdict that counts towards skipping an iteration: the result was reproducible, or
# nothing was rerun to tell.
_REPEATABLE = {"rerun_disabled", "first_rerun_reproducible", "second_rerun_reproducible"}
_LINE = re.compile(
    r"ts=.+ node=.+ device=.+ jobID=(?P<job>.+) rank=(?P<rank>\d+) "
    r"iteration=(?P<iteration>\d+) status=(?P<status>\S+) result=.+ message=.+"
)


class Tracker:
    """Appends one line per event to `path` (None: nowhere). The line is Megatron-LM's:
    `ts=... node=... device=... jobID=... rank=... iteration=... status=... result=...
    message='...'`."""

    def __init__(self, path: str | None, rank: int, device: str) -> None:
        self.path, self.rank, self.device = path, rank, device
        if path is not None:
            try:
                with open(path, "a"):
                    pass
            except OSError as error:
                raise OSError(
                    f"result_rejected_tracker_filename={path}: cannot append to it: {error}"
                ) from error

    def write(self, iteration: int, status: str, result: float, message: str) -> None:
        if self.path is None:
            return
        line = (
            f"ts={datetime.datetime.now()} node={os.uname().nodename} device={self.device} "
            f"jobID={os.environ.get('SLURM_JOBID', 'N/A')} rank={self.rank} "
            f"iteration={iteration} status={status} result={result} message='{message}'\n"
        )
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as error:  # the record is a help, not the run's purpose
            log.error("could not append to %s: %s", self.path, error)


def iterations_to_skip(path: str) -> list[int]:
    """The iterations a tracker file says to skip: one whose loss failed on the same rank
    twice, each time reproducibly or with reruns disabled (a repeatable failure: the data
    or the model, not the hardware), unless in one job it failed on several ranks. A
    status is read in either spelling (`first_rerun_reproducible` or Megatron-LM's
    `RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE`)."""
    if not os.path.exists(path):
        return []
    seen: set[tuple[int, int]] = set()
    twice: set[int] = set()
    ranks_by_job: dict[tuple[str, int], set[int]] = defaultdict(set)
    with open(path) as f:
        for line in f:
            match = _LINE.search(line)
            if match is None:
                continue
            status = match["status"].rsplit(".", 1)[-1].lower()
            if status not in _REPEATABLE:
                continue
            rank, iteration = int(match["rank"]), int(match["iteration"])
            if (rank, iteration) in seen:
                twice.add(iteration)
            seen.add((rank, iteration))
            ranks_by_job[(match["job"], iteration)].add(rank)
    several = {iteration for (_, iteration), ranks in ranks_by_job.items() if len(ranks) > 1}
    return sorted(twice - several)


class SpikeDetector:
    """A loss is a spike when its magnitude is at least `factor` x the largest of the
    first `samples` losses it was shown (which are never spikes themselves)."""

    def __init__(self, factor: float = 10.0, samples: int = 100) -> None:
        self.factor, self.samples = factor, samples
        self.count, self.largest = 0, 0.0

    def is_spike(self, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):  # nan and inf have checks of their own
            return False
        if self.count < self.samples:
            self.count += 1
            self.largest = max(self.largest, value)
            if self.count == self.samples:
                log.info("spiky-loss check: the largest of the first %d losses is %g",
                         self.samples, self.largest)  # fmt: skip
            return False
        return value >= self.factor * self.largest

    def state_dict(self) -> dict:
        return {"count": self.count, "largest": self.largest}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.largest = state["count"], state["largest"]


def relative_difference(a: float, b: float) -> float:
    """0 for the same value (nan and nan included), inf when one is finite and the other
    not (or one nan, the other inf), else |a - b| / the mean of a and b."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs((a + b) / 2) if a + b else math.inf


def summarize(differences: list[float]) -> str:
    """One line on a list of relative differences between two runs of the same things."""
    same = sum(1 for d in differences if d == 0.0)
    if same == len(differences):
        return f"{len(differences):,} compared, all identical"
    ordered = sorted(differences)
    finite = [d for d in ordered if math.isfinite(d)]
    mean = sum(finite) / len(finite) if finite else math.inf

    def at(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return (
        f"{len(differences):,} compared, {same:,} identical; relative difference mean {mean:.3e}, "
        f"p50 {at(0.5):.3e}, p90 {at(0.9):.3e}, p99 {at(0.99):.3e}, max {ordered[-1]:.3e}"
    )
