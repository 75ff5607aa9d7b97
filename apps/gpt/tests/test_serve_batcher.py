"""The server's batcher without a model: requests that wait while a batch runs are taken
together, oldest first, up to max_batch_size prompts; a full queue and a closed batcher
refuse at once; the running batch is answered after close; idle time pings."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from mp_gpt.serve_batcher import Batcher, QueueFull, ShuttingDown


class Model:
    """run(requests) records each batch and, while `hold` is clear, blocks in it."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.hold = threading.Event()
        self.running = threading.Event()
        self.pings = 0

    def run(self, requests: list[str]) -> list[str]:
        self.batches.append(list(requests))
        self.running.set()
        assert self.hold.wait(timeout=10)
        return [r.upper() for r in requests]

    def ping(self) -> None:
        self.pings += 1


async def until(condition, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_waiting_requests_are_batched_oldest_first_within_the_batch_size():
    model = Model()

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(model.run, executor, max_batch_size=4, max_queue=8,
                              idle=model.ping)  # fmt: skip
            worker = asyncio.create_task(batcher.serve())
            first = asyncio.create_task(batcher.submit("a", 1))
            await until(model.running.is_set)  # "a" runs; the others wait
            sizes = {"b": 2, "c": 1, "d": 2, "e": 1}
            rest = [asyncio.create_task(batcher.submit(r, n)) for r, n in sizes.items()]
            await until(lambda: len(batcher._waiting) == 4)
            model.hold.set()
            answers = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
            batcher.close()
            await asyncio.wait_for(worker, 10)
            return answers

    assert asyncio.run(scenario()) == ["A", "B", "C", "D", "E"]
    # b + c fill 3 of 4 prompts; d (2 more) waits for the next batch, e behind it.
    assert model.batches == [["a"], ["b", "c"], ["d", "e"]]


def test_a_full_queue_refuses_and_close_refuses_the_waiting_but_answers_the_running():
    model = Model()

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(model.run, executor, max_batch_size=4, max_queue=1,
                              idle=model.ping)  # fmt: skip
            worker = asyncio.create_task(batcher.serve())
            running = asyncio.create_task(batcher.submit("a", 1))
            await until(model.running.is_set)
            waiting = asyncio.create_task(batcher.submit("b", 1))
            await until(lambda: len(batcher._waiting) == 1)
            with pytest.raises(QueueFull, match="the queue is full"):
                await batcher.submit("c", 1)
            batcher.close()
            with pytest.raises(ShuttingDown):
                await waiting
            with pytest.raises(ShuttingDown):
                await batcher.submit("d", 1)
            model.hold.set()
            answer = await asyncio.wait_for(running, 10)
            await asyncio.wait_for(worker, 10)
            return answer

    assert asyncio.run(scenario()) == "A"
    assert model.batches == [["a"]]


def test_idle_time_pings_and_a_failed_batch_fails_only_its_requests():
    model = Model()

    def run(requests):
        if "bad" in requests:
            raise RuntimeError("generation failed")
        return requests

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(run, executor, max_batch_size=4, max_queue=4, idle=model.ping,
                              idle_seconds=0.02)  # fmt: skip
            worker = asyncio.create_task(batcher.serve())
            await until(lambda: model.pings >= 2)
            with pytest.raises(RuntimeError, match="generation failed"):
                await batcher.submit("bad", 1)
            answer = await batcher.submit("good", 1)
            batcher.close()
            await asyncio.wait_for(worker, 10)
            return answer

    assert asyncio.run(scenario()) == "good"


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="max_queue=0 must be >= 1"):
        Batcher(list, None, max_batch_size=1, max_queue=0, idle=print)
