"""The hang watchdog's judgement and its store protocol, on a fake clock and store.

(tests/faults/test_hung_rank.py stops a rank of a real torchrun job.)
"""

import pytest

from mp_train import parse_config, validate
from mp_train.configuration.config import hang_timeout_minutes
from mp_train.loop.hang_watchdog import Beat, HangMonitor, HangWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """The part of torch.distributed.Store the watchdog uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[k] for k in keys]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.data.get(key, b"")
        if current == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]


def beat(iteration: int, progress: int, tick: int, **kw) -> Beat:
    return Beat(iteration, progress, tick, **kw)


def test_a_silent_rank_is_named_once_nothing_progressed_for_the_timeout():
    clock = Clock()
    monitor = HangMonitor(3, timeout_s=15, clock=clock)
    tick = 0
    for it in range(1, 4):  # three iterations, 1 s each, every rank ticking
        tick += 1
        clock.now += 1
        assert monitor.observe({r: beat(it, it, tick) for r in range(3)}) is None
    # Rank 1 stops (SIGSTOP): its beat freezes; the others wait in a collective.
    frozen = beat(3, 3, tick, where="train.py:1 in step")
    for _ in range(4):
        tick += 1
        clock.now += 3
        assert monitor.observe({0: beat(3, 3, tick), 1: frozen, 2: beat(3, 3, tick)}) is None
    clock.now += 3
    hang = monitor.observe({0: beat(3, 3, tick + 1), 1: frozen, 2: beat(3, 3, tick + 1)})
    assert hang is not None and hang.stuck == [1] and hang.unresponsive == [1]
    assert "stuck: rank 1 stopped responding" in hang.message
    assert "last finished iteration 3" in hang.message and "train.py:1 in step" in hang.message


def test_a_live_rank_behind_the_others_is_named():
    clock = Clock()
    monitor = HangMonitor(2, timeout_s=10, clock=clock)
    monitor.observe({0: beat(1, 1, 1), 1: beat(1, 1, 1)})
    clock.now += 1
    monitor.observe({0: beat(2, 2, 2), 1: beat(1, 1, 2)})
    for tick in range(3, 20):
        clock.now += 1
        hang = monitor.observe({0: beat(2, 2, tick), 1: beat(1, 1, tick, where="io.py:9 in read")})
        if hang is not None:
            break
    assert hang.stuck == [1] and hang.unresponsive == []
    assert "rank 1 is behind the others" in hang.message and "io.py:9 in read" in hang.message
    assert clock.now - 1 >= 10


def test_the_clock_starts_at_the_first_iteration_and_stops_while_a_rank_saves():
    clock = Clock()
    monitor = HangMonitor(2, timeout_s=10, clock=clock)
    for tick in range(1, 30):  # a long model build and first iteration: no verdict
        clock.now += 1
        assert monitor.observe({0: beat(0, 0, tick), 1: beat(0, 0, tick)}) is None
    monitor.observe({0: beat(1, 1, 30), 1: beat(1, 1, 30)})
    for tick in range(31, 60):  # a long checkpoint save on rank 0
        clock.now += 1
        paused = beat(1, 1, tick, paused=True)
        assert monitor.observe({0: paused, 1: beat(1, 1, tick)}) is None
    for tick in range(60, 69):  # the save is over: a fresh allowance
        clock.now += 1
        assert monitor.observe({0: beat(1, 2, tick), 1: beat(1, 1, tick)}) is None
    clock.now += 2
    assert monitor.observe({0: beat(1, 2, 70), 1: beat(1, 1, 70)}) is not None


def test_a_closed_rank_is_not_judged():
    clock = Clock()
    monitor = HangMonitor(2, timeout_s=5, clock=clock)
    monitor.observe({0: beat(1, 1, 1), 1: beat(1, 1, 1)})
    for tick in range(2, 20):
        clock.now += 1
        left = beat(2, 2, tick, closed=True)
        assert monitor.observe({0: left, 1: left}) is None


def test_ranks_publish_and_one_judge_ends_the_job(tmp_path):
    store, clock, exits = FakeStore(), Clock(), []
    out = (tmp_path / "log").open("w+")
    dogs = [HangWatchdog(store, r, 3, 15, clock=clock, exit=exits.append, out=out, period_s=0)
            for r in range(3)]  # fmt: skip
    assert HangWatchdog(store, 0, 3, 15).period_s == 3
    dogs[2]._pid = 2**22 + 1  # above pid_max's default: the SIGKILL finds no process
    assert dogs[1].monitor is None and dogs[2].monitor is not None
    for it in range(1, 3):
        for dog in dogs:
            dog.beat(it)
        clock.now += 3
        for dog in dogs:
            assert dog.tick() is None
    # Rank 2 stops: its thread no longer ticks; rank 1 waits in a collective.
    hang = None
    for _ in range(6):
        clock.now += 3
        hang = dogs[0].tick()
        if hang is not None:
            break
        dogs[1].tick()
    assert hang is not None and hang.stuck == [2] and exits == [1]
    assert store.get("verdict") == b"0" and store.check(["dumped/0"])
    # The request reaches rank 1's thread: it dumps its stacks once and leaves too.
    dogs[1].tick()
    dogs[1].tick()
    assert exits == [1, 1]
    out.seek(0)
    text = out.read()
    assert text.count("rank 0: Python stacks (hang detected)") == 1
    assert text.count("rank 1: Python stacks (requested by rank 0)") == 1
    assert "in test_ranks_publish_and_one_judge_ends_the_job" in text
    assert store.check(["dumped/1"])


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--hang-timeout-minutes", "10"], "hang_timeout_minutes=10.0 must be below"),
        (["--hang-timeout-minutes", "-1"], "hang_timeout_minutes=-1.0 must be >= 0"),
    ],
)
def test_the_timeout_is_below_the_collective_timeout(flags, error):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--train-iters", "1", "--mock-data", "--seq-length", "16",
            "--max-position-embeddings", "16"]  # fmt: skip
    assert validate(parse_config(base), 1)["data_parallel_size"] == 1
    assert hang_timeout_minutes(parse_config(base)) == 5
    # Unset, it follows the collective timeout: a shorter one stays valid.
    shorter = parse_config([*base, "--distributed-timeout-minutes", "3"])
    assert validate(shorter, 1) and hang_timeout_minutes(shorter) == 1.5
    off = parse_config([*base, "--hang-timeout-minutes", "0"])
    assert validate(off, 1) and hang_timeout_minutes(off) == 0
    with pytest.raises(ValueError, match=error):
        validate(parse_config([*base, *flags]), 1)
