"""Batched generation with a KV cache, at any tensor- and pipeline-parallel layout.

    completions = generate_batch(model, [[464, 2068], [40]], max_new_tokens=32,
                                 sampling=[Sampling(temperature=0)] * 2, eod=50256,
                                 vocab_size=50257, pp_group=state.pp)

The prompts are left-padded to a common length and run through the model once
(prefill); then every step feeds each sequence's newest token and reads the next from
the last position's logits, the keys and values of the earlier positions coming from
the cache (mp_layers.KVCache). A sequence is done at its end-of-document token, when
its `stop` says so (stop strings) or after max_new_tokens; the batch stops when all
are.

Layouts: every tensor-parallel rank computes the full-vocabulary logits (the model is
built with parallel_output=False) and draws with the same generators, so all agree.
With pipeline stages, each step's hidden states go stage to stage
(mp_pipeline.P2PCommunicator); the last stage draws the tokens and broadcasts them
(with their log-probabilities) to every stage over the pipeline group.

Log-probabilities are those of the model's distribution (log-softmax of the logits,
before temperature, top-k or top-p), as Megatron-LM's text generation reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_layers import GPTModel, KVCache
from mp_pipeline import P2PCommunicator
from mp_state import RankGroup

__all__ = ["Completion", "Sampling", "generate_batch", "sample"]


@dataclass(frozen=True)
class Sampling:
    """How one sequence's tokens are drawn: greedy at temperature 0; else from the
    softmax of logits / temperature, kept to the top_k most likely (0: all) and to the
    smallest set whose probability reaches top_p (1: all), with a generator seeded by
    `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class Completion:
    """One prompt's generation: the new token ids (the end-of-document token included
    when it ended the sequence), their log-probabilities, why it stopped ("eod",
    "stop", "length"), and with prompt log-probabilities asked for, those of the
    prompt's tokens after its first."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_logprobs: list[float] | None = None


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id drawn from logits [vocab] (fp32) as `sampling` says."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probabilities = torch.softmax(ordered, dim=-1)
        # Drop a token once the more likely ones alone reach top_p (the first always stays).
        drop = probabilities.cumsum(-1) - probabilities >= sampling.top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate_batch(
    model: GPTModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: Sequence[Sampling],
    eod: int | None,
    vocab_size: int | None = None,
    max_length: int | None = None,
    pp_group: RankGroup | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
    prompt_logprobs: bool = False,
) -> list[Completion]:
    """Extends every prompt by up to max_new_tokens tokens (module docstring); collective
    over the model's ranks.

    max_new_tokens: for every prompt, or one per prompt. sampling: one per prompt.
    vocab_size: the tokenizer's (the rows padding the model's
    vocabulary are never drawn). max_length: the most positions a sequence may take
    (the model's position embeddings; default: the longest prompt plus
    max_new_tokens). stop(i, new_tokens): whether sequence i is done (stop strings).
    """
    if not prompts:
        return []
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling settings")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
              else list(max_new_tokens))  # fmt: skip
    if len(limits) != len(prompts) or min(limits) < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: one count >= 1 for every prompt")
    if max_length is not None:
        for prompt, limit in zip(prompts, limits, strict=True):
            if len(prompt) + limit > max_length:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens and {limit} new ones exceed the "
                    f"model's {max_length} positions"
                )
    longest = max(map(len, prompts))
    needed = longest + max(limits)
    device = next(model.parameters()).device
    stages = _Stages(model, pp_group, device)
    padding = torch.tensor([longest - len(p) for p in prompts])
    cache = KVCache(padding, needed, all_logits=prompt_logprobs)
    step_input = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts],
                              device=device)  # fmt: skip
    generators = [torch.Generator().manual_seed(s.seed) for s in sampling]
    completions = [Completion(list(p)) for p in prompts]
    running = list(range(len(prompts)))
    for step in range(max(limits)):
        logits = stages.forward(step_input, cache)  # [b, s, v] on the last stage, else None
        if logits is not None and prompt_logprobs and step == 0:
            _prompt_logprobs(logits, step_input, padding, completions, vocab_size)
        drawn = None
        if logits is not None:
            drawn = _draw(logits[:, -1, :vocab_size].float(), sampling, generators)
        tokens, logprobs = stages.from_last(drawn, len(prompts))
        for i in list(running):
            completion = completions[i]
            completion.tokens.append(tokens[i])
            completion.logprobs.append(logprobs[i])
            if eod is not None and tokens[i] == eod:
                completion.finish_reason = "eod"
            elif stop is not None and stop(i, completion.tokens):
                completion.finish_reason = "stop"
            elif len(completion.tokens) < limits[i]:
                continue
            running.remove(i)
        if not running:
            break
        step_input = torch.tensor(tokens, device=device)[:, None]
    return completions


def _draw(last: torch.Tensor, sampling: Sequence[Sampling], generators) -> torch.Tensor:
    """[2, b] float64: the token drawn for each sequence from its logits last [b, v] (fp32)
    and its log-probability. Greedy rows take one argmax over the batch, on the logits'
    device; only sampled rows go to the CPU, for their generators."""
    tokens = torch.argmax(last, dim=-1)
    sampled = [i for i, s in enumerate(sampling) if s.temperature > 0]
    if sampled:
        rows = last[sampled].cpu()
        drawn = [sample(rows[j], sampling[i], generators[i]) for j, i in enumerate(sampled)]
        tokens[sampled] = torch.tensor(drawn, device=tokens.device)
    chosen = F.log_softmax(last, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return torch.stack([tokens.double(), chosen.double()]).cpu()


def _prompt_logprobs(logits, prompt_ids, padding, completions, vocab_size) -> None:
    """Each prompt's log-probabilities of its tokens after the first, from the prefill's
    logits [b, s, v]."""
    logprobs = F.log_softmax(logits[:, :-1, :vocab_size].float(), dim=-1)
    following = prompt_ids[:, 1:, None].to(logprobs.device)
    picked = logprobs.gather(-1, following)[..., 0].cpu()
    for i, completion in enumerate(completions):
        completion.prompt_logprobs = picked[i, int(padding[i]) :].tolist()


class _Stages:
    """This rank's part of a step: receive the previous stage's hidden states, run this
    stage, send them on; and the drawn tokens from the last stage to every stage."""

    def __init__(self, model: GPTModel, pp_group: RankGroup | None, device) -> None:
        self.model = model
        self.pp = pp_group if pp_group is not None and pp_group.size > 1 else None
        self.device = device
        self.p2p = None
        if self.pp is not None:
            dtype = next(model.parameters()).dtype
            self.p2p = P2PCommunicator(self.pp, None, dtype=dtype, device=device,
                                       variable_seq_lengths=True)  # fmt: skip

    def forward(self, step_input: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        if self.pp is None:
            return self.model(step_input, kv_cache=cache)
        first, last = self.pp.rank == 0, self.pp.rank == self.pp.size - 1
        hidden = None if first else self.p2p.recv_forward()
        out = self.model(step_input if first else None, decoder_input=hidden, kv_cache=cache)
        if not last:
            self.p2p.send_forward(out)
            return None
        return out

    def from_last(self, drawn: torch.Tensor | None, b: int) -> tuple[list[int], list[float]]:
        """The tokens and log-probabilities the last stage drew, on every stage."""
        if self.pp is not None:
            # On the model's device: nccl broadcasts CUDA tensors only.
            drawn = (torch.empty(2, b, dtype=torch.float64, device=self.device) if drawn is None
                     else drawn.to(self.device))  # fmt: skip
            dist.broadcast(drawn, src=self.pp.ranks[-1], group=self.pp.group)
            drawn = drawn.cpu()
        return [int(t) for t in drawn[0].tolist()], drawn[1].tolist()
