"""The text generation server's request and response, as Megatron-LM's `PUT /api`
(tools/run_text_generation_server.py) reads and writes them.

A request is a JSON object: `prompts` (a list of strings, required), and optionally
`tokens_to_generate` (int >= 0, default 64), `logprobs` (bool), `temperature`
(0 < t <= 100, default 1.0), `top_k` (0..1000, 0: off; 1 is greedy), `top_p` (0..1,
0: off; not with top_k), `random_seed` (int >= 0), `add_BOS` (bool). Megatron's fields
that mp does not implement (`top_p_decay`, `top_p_bound`, `stop_on_eol`,
`stop_on_double_eol`, `prevent_newline_after_colon`, `length_penalty`, a `stop_token`
other than the model's end-of-document token) are accepted only at the value that
asks for nothing; any other value, and any field Megatron does not know, is refused.
A refusal is a `RequestError` whose message names the field (Megatron's wording where
it has one).

The response holds, per prompt: `text` (the prompt as sent followed by the generated
text, the end-of-document token left out), `segments` (each token's text, prompt and
generation), `tokens` (their ids) and, when `logprobs` is true, `logprobs`: the
log-probability of every token after the first (the prompt's, then the generated
ones), under the model's distribution before temperature, top-k or top-p.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from mp_gpt.generation import Completion, Sampling

__all__ = ["GenerateRequest", "RequestError", "Vocabulary", "parse_request", "response"]

MAX_PROMPTS = 128
"""Megatron's limit on the prompts of one request."""

_RETIRED = {
    "max_len": "max_len is no longer used.  Replace with tokens_to_generate",
    "sentences": "sentences is no longer used.  Replace with prompts",
    "beam_width": "Beam search is no longer supported.",
}
_NO_OP = {  # Megatron's fields mp does not implement -> the value that asks for nothing
    "top_p_decay": 0.0,
    "top_p_bound": 0.0,
    "stop_on_eol": False,
    "stop_on_double_eol": False,
    "prevent_newline_after_colon": False,
    "length_penalty": 1.0,
}
_KNOWN = {"prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p",
          "random_seed", "add_BOS", "stop_token", *_NO_OP}  # fmt: skip


class RequestError(ValueError):
    """A request the server refuses (HTTP 400); the message names the field."""


@dataclass(frozen=True)
class Vocabulary:
    """What reading a request needs from the model: its tokenizer, end-of-document
    token and number of positions."""

    tokenizer: object
    eod: int | None
    max_length: int


@dataclass(frozen=True)
class GenerateRequest:
    """One valid request: its prompts as sent and as token ids, and how to extend them."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    tokens_to_generate: int
    logprobs: bool
    sampling: list[Sampling]  # one per prompt


def parse_request(body: object, vocabulary: Vocabulary, max_prompts: int) -> GenerateRequest:
    """The request in a decoded JSON body, validated as Megatron validates it (module
    docstring); max_prompts: the server's batch size."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    for name, message in _RETIRED.items():
        if name in body:
            raise RequestError(message)
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}; the fields are "
                           f"{', '.join(sorted(_KNOWN))}")  # fmt: skip
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    limit = min(MAX_PROMPTS, max_prompts)
    if len(prompts) > limit:
        raise RequestError(f"Maximum number of prompts is {limit} (prompts has {len(prompts)})")

    tokens = body.get("tokens_to_generate", 64)
    if not _is_int(tokens) or tokens < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError("logprobs must be a boolean value")
    if tokens == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0.0 < temperature <= 100.0:
        raise RequestError("temperature must be a positive number less than or equal to 100.0")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k) or not 0 <= top_k <= 1000:
        raise RequestError(
            "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"
        )
    top_p = body.get("top_p", 0.0)
    if not _is_number(top_p) or not 0.0 <= top_p <= 1.0:
        raise RequestError("top_p must be a positive float less than or equal to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    _check_no_ops(body)
    add_bos = body.get("add_BOS", False)
    if not isinstance(add_bos, bool):
        raise RequestError("add_BOS must be a boolean value")
    if add_bos and vocabulary.eod is None:
        raise RequestError("add_BOS: this model has no end-of-document token to prepend")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    seed = body.get("random_seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise RequestError("random_seed must be a positive integer")
    stop_token = body.get("stop_token", vocabulary.eod)
    if not _is_int(stop_token):
        raise RequestError("stop_token must be an integer")
    if stop_token != vocabulary.eod:
        raise RequestError(f"stop_token={stop_token} is not supported: generation stops at "
                           f"this model's end-of-document token, {vocabulary.eod}")  # fmt: skip

    prompt_ids = [_tokenize(vocabulary, i, p, add_bos, tokens) for i, p in enumerate(prompts)]
    # Megatron's top_k=1 is argmax; top_p=0 is "no top-p" (mp's 1).
    greedy = top_k == 1
    base = random.getrandbits(62) if seed is None else seed
    sampling = [Sampling(0.0 if greedy else float(temperature), 0 if greedy else top_k,
                         float(top_p) or 1.0, base + i) for i in range(len(prompts))]  # fmt: skip
    return GenerateRequest(prompts, prompt_ids, tokens, logprobs, sampling)


def _check_no_ops(body: dict) -> None:
    for name, nothing in _NO_OP.items():
        if name not in body:
            continue
        value = body[name]
        kind = bool if isinstance(nothing, bool) else float
        valid = isinstance(value, bool) if kind is bool else _is_number(value)
        if not valid:
            raise RequestError(f"{name} must be a {'boolean value' if kind is bool else 'float'}")
        if value != nothing:
            raise RequestError(f"{name}={value!r} is not supported by mp's server "
                               f"(only {nothing!r}, which asks for nothing)")  # fmt: skip


def _tokenize(vocabulary: Vocabulary, i: int, prompt: str, add_bos: bool, tokens: int):
    try:
        ids = vocabulary.tokenizer.tokenize(prompt) if prompt else []
    except ValueError as error:
        raise RequestError(f"prompts[{i}]: {error}") from None
    if add_bos:
        ids = [vocabulary.eod, *ids]
    # Scoring a prompt (tokens_to_generate=0) still draws one token, not returned.
    if len(ids) + max(tokens, 1) > vocabulary.max_length:
        raise RequestError(
            f"prompts[{i}] has {len(ids)} tokens: with tokens_to_generate={tokens} it is "
            f"longer than the model's {vocabulary.max_length} positions"
        )
    return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def response(requests_completions: Sequence[tuple[GenerateRequest, Sequence[Completion]]],
             vocabulary: Vocabulary) -> list[dict]:  # fmt: skip
    """Each request's response body from its prompts' completions."""
    return [_response(request, completions, vocabulary)
            for request, completions in requests_completions]  # fmt: skip


def _response(request: GenerateRequest, completions: Sequence[Completion],
              vocabulary: Vocabulary) -> dict:  # fmt: skip
    tokenizer, eod = vocabulary.tokenizer, vocabulary.eod
    body: dict = {"text": [], "segments": [], "tokens": []}
    if request.logprobs:
        body["logprobs"] = []
    for prompt, completion in zip(request.prompts, completions, strict=True):
        new = completion.tokens[: request.tokens_to_generate]
        ids = completion.prompt + new
        body["text"].append(prompt + _generated_text(tokenizer, eod, completion.prompt, new))
        body["segments"].append([tokenizer.detokenize([t]) for t in ids])
        body["tokens"].append(ids)
        if request.logprobs:
            generated = completion.logprobs[: len(new)]
            body["logprobs"].append(list(completion.prompt_logprobs or []) + generated)
    return body


def _generated_text(tokenizer, eod: int | None, prompt: list[int], new: list[int]) -> str:
    """The text the new tokens add after the prompt's: detokenized with the prompt, as a
    tokenizer may join or merge across the boundary (NullTokenizer's spaces)."""
    new = [t for t in new if t != eod]
    if not new:
        return ""
    before = tokenizer.detokenize([t for t in prompt if t != eod])
    whole = tokenizer.detokenize([t for t in prompt if t != eod] + new)
    return whole[len(before) :] if whole.startswith(before) else tokenizer.detokenize(new)
