"""A text generation server for a checkpoint: Megatron-LM's `PUT /api`.

Compatible with Megatron-LM's tools/run_text_generation_server.py:

    python -m mp_gpt.serve --load runs/quickstart/checkpoints [--port 5000]
    torchrun --nproc-per-node 2 -m mp_gpt.serve --load DIR --tensor-model-parallel-size 2
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["The function"], "tokens_to_generate": 32, "top_k": 1}'

Every rank builds the model (mp_gpt.generate.Generator; layout options pass through);
rank 0 serves HTTP (aiohttp) on --host (127.0.0.1 by default) and leads the other
ranks (mp_gpt.serve_ranks). Requests that arrive while a batch generates are taken
together into the next one, up to --max-batch-size prompts (mp_gpt.serve_batcher);
at most --max-queue requests wait, a request beyond that gets 503. The request and
response are Megatron's (mp_gpt.serve_request); a refused request gets 400 and
`{"error": message}` naming the field. SIGTERM (or SIGINT) stops the server: it
stops listening, answers waiting requests with 503, lets the running batch finish
and answer, stops the other ranks and exits 0. docs/serving.md has the details.
"""

from __future__ import annotations

from mp_gpt import program

if __name__ == "__main__":
    program.imports_begin()  # started as a program: mp_gpt.program says why

import argparse
import asyncio
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from mp_gpt.generate import Generator
from mp_gpt.serve_batcher import Batcher, QueueFull, ShuttingDown
from mp_gpt.serve_ranks import PING, STOP, Batch, follow, lead
from mp_gpt.serve_request import (
    MAX_PROMPTS,
    GenerateRequest,
    RequestError,
    Vocabulary,
    parse_request,
    response,
)

try:
    from aiohttp import web
except ImportError:  # the `serve` extra
    web = None

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mp_gpt.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--load", required=True, help="checkpoint root (or its iteration dir)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=5000, help="port (0: any free one)")
    parser.add_argument("--max-batch-size", type=int, default=MAX_PROMPTS,
                        help="most prompts generated together in one batch")  # fmt: skip
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests waiting while a batch runs; more get 503")  # fmt: skip
    parser.add_argument("--heartbeat-seconds", type=float, default=60.0,
                        help="idle seconds after which rank 0 pings the other ranks (below "
                        "--distributed-timeout-minutes)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if web is None:
        parser.error("the server needs aiohttp: pip install 'mp-gpt[serve]'")
    for name in ("max_batch_size", "max_queue"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.heartbeat_seconds <= 0:
        parser.error(f"--heartbeat-seconds {args.heartbeat_seconds} must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is not a port number (0..65535)")
    generator = Generator(args.load, extra)
    try:
        if generator.tokenizer is None:
            parser.error(f"{args.load}: the checkpoint keeps no tokenizer; the server takes "
                         "text prompts")  # fmt: skip
        if dist.get_rank() == 0:
            asyncio.run(_serve(generator, args))
        else:
            # torchrun passes SIGTERM to every worker: a follower stops when rank 0,
            # stopping on the same signal, tells it to.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(generator)
    finally:
        generator.close()
    return 0


async def _serve(generator: Generator, args) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    vocabulary = Vocabulary(generator.tokenizer, generator.eod, generator.max_length)
    executor = ThreadPoolExecutor(1, thread_name_prefix="mp-serve-model")  # one: collectives

    def run(requests: list[GenerateRequest]) -> list[dict]:
        return _generate(generator, vocabulary, requests)

    batcher = Batcher(run, executor, max_batch_size=args.max_batch_size,
                      max_queue=args.max_queue, idle=lambda: lead(generator, PING),
                      idle_seconds=args.heartbeat_seconds)  # fmt: skip
    app = web.Application()
    app.router.add_put("/api", _handler(batcher, vocabulary, args.max_batch_size))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as error:
            raise SystemExit(f"error: mp_gpt.serve: cannot listen on {args.host}:{args.port}: "
                             f"{error}") from None  # fmt: skip
        host, port = runner.addresses[0][:2]
        print(f"mp_gpt.serve: serving http://{host}:{port}/api", flush=True)
        worker = asyncio.create_task(batcher.serve())
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait([worker, stop], return_when=asyncio.FIRST_COMPLETED)
        print("mp_gpt.serve: stopping", flush=True)
        await site.stop()
        batcher.close()
        try:
            await worker  # the running batch answers; a failed worker ends the server
        finally:
            stop.cancel()
    finally:  # however rank 0 ends, the other ranks stop too
        await runner.cleanup()
        await loop.run_in_executor(executor, lead, generator, STOP)
        executor.shutdown()
    print("mp_gpt.serve: stopped", flush=True)


def _handler(batcher: Batcher, vocabulary: Vocabulary, max_batch_size: int):
    async def put_api(http_request: web.Request) -> web.Response:
        try:
            body = await http_request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return _error(400, f"the request body is not valid JSON: {error}")
        try:
            request = parse_request(body, vocabulary, max_batch_size)
        except RequestError as error:
            return _error(400, str(error))
        try:
            result = await batcher.submit(request, len(request.prompts))
        except (QueueFull, ShuttingDown) as error:
            return _error(503, str(error))
        except ValueError as error:
            return _error(400, str(error))
        except Exception as error:
            return _error(500, f"generation failed: {type(error).__name__}: {error}")
        return web.json_response(result)

    return put_api


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _generate(generator: Generator, vocabulary: Vocabulary,
              requests: list[GenerateRequest]) -> list[dict]:  # fmt: skip
    """One batch of all the requests' prompts, on the worker thread (collective)."""
    batch = Batch(
        prompts=[ids for r in requests for ids in r.prompt_ids],
        max_new_tokens=[max(r.tokens_to_generate, 1) for r in requests for _ in r.prompts],
        sampling=[s for r in requests for s in r.sampling],
        prompt_logprobs=any(r.logprobs for r in requests),
        logprobs_from=generator.state.pp.ranks[-1],
    )
    start_time = time.monotonic()
    completions = lead(generator, batch)
    print(f"mp_gpt.serve: batch of {len(requests)} request(s), {len(batch.prompts)} prompt(s) "
          f"in {time.monotonic() - start_time:.2f} s", flush=True)  # fmt: skip
    pairs, start = [], 0
    for request in requests:
        pairs.append((request, completions[start : start + len(request.prompts)]))
        start += len(request.prompts)
    return response(pairs, vocabulary)


if __name__ == "__main__":
    sys.exit(program.run(main))
