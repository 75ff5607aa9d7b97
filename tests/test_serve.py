"""`python -m mp_gpt.serve` as a real process on a free port, asked over HTTP: concurrent
requests batched and answered with the greedy text of `Generator.complete`; bad
requests refused with 400 naming the field; a full queue refused with 503; SIGTERM
answers the running batch, refuses the waiting requests and exits 0; the same greedy
text and log-probabilities at TP 2 and PP 2 under torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mp_gpt.testing import GIVEN_PEAK
from mp_state.testing import TorchrunJob, run_on_ranks

CONFIG = Path(__file__).resolve().parents[1] / "apps" / "gpt" / "configs" / "tiny.yaml"
EOD = 999  # NullTokenizer(vocab_size=1000)
PROMPTS = ["1 2 3", "7", "40 41", "5 6 7 8", "998", "12 0"]
TOKENS = [6, 9, 3, 12, 1, 7]  # new tokens asked for each prompt
SLOW = {"prompts": ["1 2 3"] * 16, "tokens_to_generate": 1000, "top_k": 1}  # seconds on a CPU


def train_body(run_dir: str, *layout: str):
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MP_RUN_DIR", "/nonexistent")
    from mp_gpt.pretrain import main

    return main([
        "--config", str(CONFIG), "--mock-data", *GIVEN_PEAK, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--make-vocab-size-divisible-by", "512", "--seq-length", "32",
        "--max-position-embeddings", "1024", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "none",
        "--save", run_dir, "--load", run_dir, "--tensorboard-dir", "none", "--num-workers", "0",
        "--lr-warmup-iters", "0", "--log-interval", "100", *layout,
    ])  # fmt: skip


def greedy_body(run_dir: str, prompts: list[str], tokens: list[int]):
    """Each prompt's greedy new token ids and its log-probabilities (the prompt's after
    its first, then the new tokens') from Generator.complete, one prompt at a time; and,
    as the generator started the world itself (as under `python -m mp_gpt.serve`), the
    gloo threads there were before and after its close(), and whether the world was
    still up."""
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from mp_gpt.generate import Generator
    from mp_gpt.generation import Sampling

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        del os.environ[name]  # no launcher: the generator makes a one-rank world
    generator = Generator(run_dir)
    try:
        found = []
        for prompt, n in zip(prompts, tokens, strict=True):
            [done] = generator.complete([generator.tokenizer.tokenize(prompt)], max_new_tokens=n,
                                        sampling=[Sampling()], prompt_logprobs=True)  # fmt: skip
            found.append((done.tokens, done.prompt_logprobs + done.logprobs))
        before = gloo_threads()
    finally:
        generator.close()
    return found, (before, gloo_threads(), dist.is_initialized())


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (pt_gloo_runloop: a process
    group's workers; gloo_tcp_loop: its connections)."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return sorted(name for name in names if "gloo" in name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("serve") / "run")
    run_on_ranks(train_body, 1, run_dir, timeout=120)
    return run_dir


@pytest.fixture(scope="module")
def greedy(checkpoint):
    """greedy_body's answers for PROMPTS, TOKENS, in a rank without a process group."""
    return run_on_ranks(greedy_body, 1, checkpoint, PROMPTS, TOKENS, timeout=120,
                        init_process_group=False)[0]  # fmt: skip


@pytest.fixture(scope="module")
def wanted(greedy) -> list[tuple[list[int], list[float]]]:
    """Generator.complete's greedy new tokens and log-probabilities for PROMPTS, TOKENS."""
    return greedy[0]


@pytest.mark.multirank
def test_a_closed_generator_has_ended_the_world_it_started_and_every_gloo_thread(greedy):
    # A gloo worker thread that outlives close() can release a collective's Python
    # tensors once the interpreter is finalizing: the server then aborted at exit.
    before, after, world_up = greedy[1]
    assert "pt_gloo_runloop" in before, before  # the threads are seen while they run
    assert after == [] and not world_up, (after, world_up)


def serving_url(output: str) -> str | None:
    found = re.search(r"mp_gpt\.serve: serving (http://\S+)", output)
    return found.group(1) if found else None


class Server:
    """`python -m mp_gpt.serve --port 0 ...` in a session of its own, its output in a
    file; killed on leaving the `with` block if still running."""

    def __init__(self, load: str, log: Path, *options: str) -> None:
        self.log = log
        command = [sys.executable, "-m", "mp_gpt.serve", "--load", load, "--port", "0", *options]
        with log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
        deadline = time.monotonic() + 90
        while (url := serving_url(self.output())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"the server did not start:\n{self.output()[-4000:]}")
            time.sleep(0.05)
        self.url = url

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def put(url: str, body, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="PUT",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def in_threads(calls) -> list:
    """Runs each () -> value on its own thread at once; their values, in order."""
    results = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a client got no answer within 120 s"
    return results


def check_greedy(replies, wanted) -> None:
    """Each reply holds the prompt's greedy tokens, text, segments and log-probabilities
    as Generator.complete gives them."""
    for prompt, (status, body), (new, logprobs) in zip(PROMPTS, replies, wanted, strict=True):
        assert status == 200, body
        ids = [int(t) for t in prompt.split()]
        assert body["tokens"] == [ids + new]
        assert body["text"] == [" ".join(str(t) for t in ids + new if t != EOD)]
        assert body["segments"] == [[str(t) for t in ids + new]]
        assert body["logprobs"][0] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.multirank
def test_concurrent_requests_are_batched_and_answered_with_generator_greedy(
    checkpoint, wanted, tmp_path
):
    with Server(checkpoint, tmp_path / "server.log") as server:
        slow = threading.Thread(target=put, args=(server.url, SLOW))
        slow.start()  # the queries below wait for it and are batched together
        time.sleep(0.5)
        replies = in_threads([
            lambda p=p, n=n: put(server.url, {"prompts": [p], "tokens_to_generate": n,
                                              "top_k": 1, "logprobs": True})
            for p, n in zip(PROMPTS, TOKENS, strict=True)
        ])  # fmt: skip
        slow.join(timeout=120)
        check_greedy(replies, wanted)
        batches = re.findall(r"batch of (\d+) request", server.output())
        assert len(batches) < 1 + len(PROMPTS) and max(map(int, batches)) > 1, batches


@pytest.mark.multirank
def test_bad_requests_get_400_naming_the_field_and_a_full_queue_503(checkpoint, tmp_path):
    with Server(checkpoint, tmp_path / "server.log", "--max-queue", "1") as server:
        refusals = {
            b'{"prompts": [1 2': "the request body is not valid JSON",
            b"{}": "prompts argument required",
            b'{"prompts": ["1"], "tokens_to_generate": -2}': "tokens_to_generate must be",
            b'{"prompts": ["1"], "temperature": "hot"}': "temperature must be",
            b'{"prompts": "1 2"}': "prompts is not a list of strings",
            b'{"prompts": ["1"], "num_beams": 2}': "unknown field(s) num_beams",
            b'{"prompts": ["1"], "stop_on_eol": true}': "stop_on_eol=True is not supported",
            b'{"prompts": ["1"], "tokens_to_generate": 1024}': "tokens_to_generate=1024",
        }
        for body, message in refusals.items():
            status, reply = put(server.url, body)
            assert status == 400 and message in reply["error"], (body, reply)

        running, waiting = [], []
        first = threading.Thread(target=lambda: running.append(put(server.url, SLOW)))
        first.start()
        time.sleep(0.5)  # generating
        second = threading.Thread(target=lambda: waiting.append(put(server.url, SLOW)))
        second.start()
        time.sleep(0.5)  # queued: the queue is full
        status, reply = put(server.url, {"prompts": ["1"], "tokens_to_generate": 1})
        assert status == 503 and "the queue is full" in reply["error"], reply

        # SIGTERM: the running batch is answered, the waiting request refused, exit 0.
        server.process.send_signal(signal.SIGTERM)
        second.join(timeout=30)
        assert waiting and waiting[0][0] == 503, waiting
        assert "shutting down" in waiting[0][1]["error"]
        start = time.monotonic()
        assert server.process.wait(timeout=30) == 0, server.output()[-4000:]
        first.join(timeout=30)
        assert time.monotonic() - start < 30
        assert running and running[0][0] == 200 and len(running[0][1]["text"]) == 16, running
        assert "mp_gpt.serve: stopped" in server.output()
        with pytest.raises(urllib.error.URLError):
            put(server.url, {"prompts": ["1"]}, timeout=5)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("layout", "signalled"),
    [("--tensor-model-parallel-size", "rank 0"), ("--pipeline-model-parallel-size", "torchrun")],
)
def test_tp2_and_pp2_under_torchrun_give_the_same_greedy_text_and_stop_on_sigterm(
    checkpoint, wanted, tmp_path, layout, signalled
):
    target = ["-m", "mp_gpt.serve", "--load", checkpoint, "--port", "0", layout, "2"]
    with TorchrunJob(target, tmp_path, nproc=2) as job:
        job.wait_for(lambda: serving_url(job.output()) is not None, "the server", timeout=120)
        url = serving_url(job.output())
        replies = in_threads([
            lambda p=p, n=n: put(url, {"prompts": [p], "tokens_to_generate": n, "top_k": 1,
                                       "logprobs": True})
            for p, n in zip(PROMPTS, TOKENS, strict=True)
        ])  # fmt: skip
        check_greedy(replies, wanted)
        if signalled == "rank 0":
            os.kill(job.workers()[0], signal.SIGTERM)  # rank 0 stops rank 1
            assert job.wait(timeout=60) < 60
            assert job.returncode == 0, job.output()[-4000:]
        else:  # torchrun sends SIGTERM to both ranks; rank 1 waits for rank 0's word
            job.process.send_signal(signal.SIGTERM)
            assert job.wait(timeout=60) < 20  # not torchrun's 30 s grace before SIGKILL
            assert "mp_gpt.serve: stopped" in job.output(), job.output()[-4000:]
