"""The server's request validation (Megatron's messages, naming the field), its mapping
onto mp's sampling, and the response's fields, without a model."""

import pytest

from mp_data import build_tokenizer
from mp_gpt.generation import Completion, Sampling
from mp_gpt.serve_request import RequestError, Vocabulary, parse_request, response

NULL = build_tokenizer("NullTokenizer", vocab_size=101)  # eod 100
VOCABULARY = Vocabulary(NULL, NULL.eod, max_length=16)


def parse(body, max_prompts=8):
    return parse_request(body, VOCABULARY, max_prompts)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "the request body must be a JSON object, not list"),
        ({}, "prompts argument required"),
        ({"prompts": ["1"], "max_len": 4}, "max_len is no longer used"),
        ({"prompts": ["1"], "beam_width": 2}, "Beam search is no longer supported"),
        ({"prompts": ["1"], "n": 2}, "unknown field(s) n;"),
        ({"prompts": "1 2"}, "prompts is not a list of strings"),
        ({"prompts": [1, 2]}, "prompts is not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["1"] * 9}, "Maximum number of prompts is 8 (prompts has 9)"),
        ({"prompts": ["1"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer"),
        ({"prompts": ["1"], "tokens_to_generate": "4"}, "tokens_to_generate must be an integer"),
        ({"prompts": ["1"], "tokens_to_generate": 2.0}, "tokens_to_generate must be an integer"),
        ({"prompts": ["1"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs"),
        ({"prompts": ["1"], "logprobs": "yes"}, "logprobs must be a boolean value"),
        ({"prompts": ["1"], "temperature": 0}, "temperature must be a positive number"),
        ({"prompts": ["1"], "temperature": True}, "temperature must be a positive number"),
        ({"prompts": ["1"], "top_k": 1001}, "top_k must be an integer"),
        ({"prompts": ["1"], "top_p": 1.5}, "top_p must be a positive float"),
        ({"prompts": ["1"], "top_k": 2, "top_p": 0.5}, "cannot set both top-k and top-p"),
        ({"prompts": ["1"], "top_p_decay": 0.5}, "top_p_decay=0.5 is not supported"),
        ({"prompts": ["1"], "stop_on_eol": True}, "stop_on_eol=True is not supported"),
        ({"prompts": ["1"], "stop_on_eol": 1}, "stop_on_eol must be a boolean value"),
        ({"prompts": ["1"], "length_penalty": 2.0}, "length_penalty=2.0 is not supported"),
        ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ({"prompts": ["1"], "random_seed": -3}, "random_seed must be a positive integer"),
        ({"prompts": ["1"], "stop_token": 7}, "stop_token=7 is not supported"),
        ({"prompts": ["1 x"]}, "prompts[0]: NullTokenizer: 'x' is not an integer id"),
        ({"prompts": ["1", "1 2"], "tokens_to_generate": 15},
         "prompts[1] has 2 tokens: with tokens_to_generate=15 it is longer than the model's 16"),
    ],
)  # fmt: skip
def test_a_bad_request_is_refused_naming_the_field(body, message):
    with pytest.raises(RequestError) as error:
        parse(body)
    assert message in str(error.value)


def test_megatron_sampling_maps_onto_mp_sampling():
    greedy = parse({"prompts": ["1", "2 3"], "top_k": 1, "tokens_to_generate": 4})
    assert greedy.sampling == [Sampling(0.0, 0, 1.0, s.seed) for s in greedy.sampling]
    assert greedy.prompt_ids == [[1], [2, 3]] and greedy.tokens_to_generate == 4
    nucleus = parse({"prompts": ["1", "2"], "temperature": 0.5, "top_p": 0.9,
                     "random_seed": 7, "tokens_to_generate": 4})  # fmt: skip
    assert nucleus.sampling == [Sampling(0.5, 0, 0.9, 7), Sampling(0.5, 0, 0.9, 8)]
    body = {"prompts": ["1"], "top_p_decay": 0.0, "stop_token": 100, "add_BOS": True}
    default = parse_request(body, Vocabulary(NULL, NULL.eod, max_length=66), 8)
    assert default.sampling[0].temperature == 1.0 and default.sampling[0].top_p == 1.0
    assert default.prompt_ids == [[100, 1]] and default.tokens_to_generate == 64


def test_the_response_holds_text_segments_tokens_and_logprobs():
    request = parse({"prompts": ["1  2", "3"], "tokens_to_generate": 2, "logprobs": True})
    completions = [
        Completion([1, 2], [5, 6], [-0.5, -0.25], "length", [-1.0]),
        Completion([3], [100], [-0.125], "eod", []),
    ]
    [body] = response([(request, completions)], VOCABULARY)
    assert body["text"] == ["1  2 5 6", "3"]  # the prompt as sent; the eod left out
    assert body["segments"] == [["1", "2", "5", "6"], ["3", "100"]]
    assert body["tokens"] == [[1, 2, 5, 6], [3, 100]]
    assert body["logprobs"] == [[-1.0, -0.5, -0.25], [-0.125]]
    scored = parse({"prompts": ["1 2"], "tokens_to_generate": 0, "logprobs": True})
    [body] = response([(scored, [Completion([1, 2], [9], [-3.0], "length", [-1.0])])],
                      VOCABULARY)  # fmt: skip
    assert body == {"text": ["1 2"], "segments": [["1", "2"]], "tokens": [[1, 2]],
                    "logprobs": [[-1.0]]}  # fmt: skip
    plain = parse({"prompts": ["1"], "tokens_to_generate": 1})
    [body] = response([(plain, [Completion([1], [9], [-3.0])])], VOCABULARY)
    assert "logprobs" not in body and body["text"] == ["1 9"]
