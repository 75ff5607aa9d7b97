"""Work for every rank of the server's model: rank 0 (the HTTP server) leads, the
other ranks follow.

Rank 0 sends each message to all ranks over the world group
(`torch.distributed.broadcast_object_list`): a `Batch` to generate, which every rank
then passes to `Generator.complete` (a collective); `PING` while idle, so that a
follower waiting in the broadcast never reaches the process group's timeout; `STOP`,
after which the followers return. With pipeline stages only the last stage computes
the prompts' log-probabilities; it sends them to every rank after the batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist

from mp_gpt.generate import Generator
from mp_gpt.generation import Completion, Sampling

__all__ = ["PING", "STOP", "Batch", "follow", "lead"]

PING = "ping"
STOP = "stop"


@dataclass(frozen=True)
class Batch:
    """One `generate_batch` call: the prompts of the requests taken together, each with
    its own number of new tokens and sampling."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    sampling: list[Sampling]
    prompt_logprobs: bool
    logprobs_from: int  # the world rank of the last stage of rank 0's pipeline


def lead(generator: Generator, message: Batch | str) -> list[Completion] | None:
    """On rank 0: sends `message` to the other ranks and, for a Batch, generates with
    them; returns the completions (None for PING and STOP)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list([message], src=0)
    return _run(generator, message) if isinstance(message, Batch) else None


def follow(generator: Generator) -> None:
    """On every rank but 0: runs what rank 0 sends until it sends STOP."""
    while True:
        received = [None]
        dist.broadcast_object_list(received, src=0)
        message = received[0]
        if message == STOP:
            return
        if isinstance(message, Batch):
            # A ValueError is raised alike on rank 0, which answers the requests with it.
            with contextlib.suppress(ValueError):
                _run(generator, message)


def _run(generator: Generator, batch: Batch) -> list[Completion]:
    completions = generator.complete(
        batch.prompts, max_new_tokens=batch.max_new_tokens, sampling=batch.sampling,
        prompt_logprobs=batch.prompt_logprobs,
    )  # fmt: skip
    if batch.prompt_logprobs and generator.state.pp.size > 1:
        shared = [[c.prompt_logprobs for c in completions]]
        dist.broadcast_object_list(shared, src=batch.logprobs_from)
        for completion, logprobs in zip(completions, shared[0], strict=True):
            completion.prompt_logprobs = logprobs
    return completions
