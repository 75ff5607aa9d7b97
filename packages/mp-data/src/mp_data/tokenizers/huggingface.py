"""Any tokenizer saved as a Hugging Face tokenizer.json (Llama, Mistral, Qwen, GPT-NeoX, ...).

`HuggingFaceTokenizer(path)` reads a local tokenizer.json, given as the file
or as the folder holding it; nothing is ever downloaded. Ids are those of
Megatron's HuggingFaceTokenizer, whose `tokenize` is transformers'
`tokenizer(text).input_ids` (megatron-core 0.19's by default, and the legacy
megatron/training one): the tokenizer's post-processor runs, so a Llama
tokenizer starts every text with <s>.
Its `detokenize` keeps special tokens, like transformers' `decode`. The
tokenizer's special tokens are matched in the text (transformers' behaviour)
unless `special_tokens_as_text` (base.py).

tokenizer.json says how to tokenize but not which token plays which role;
transformers reads that from tokenizer_config.json and special_tokens_map.json
beside it, and so do we (the second overrides the first, as in transformers):

- eod: their "eos_token"; failing that, the first of <|endoftext|>,
  <|end_of_text|>, </s>, <eos> in the vocabulary (GPT-2, Llama 3, Llama 2 and
  Gemma conventions); failing that None, as Megatron's eod is then.
- bos: their "bos_token", else None.
- pad: their "pad_token"; failing that, the pad id of tokenizer.json's
  padding settings; else None.

A role naming a token the vocabulary lacks is an error (transformers would
silently add a token the model has no embedding for). `identity` hashes
tokenizer.json and the two role files.
"""

from __future__ import annotations

import json
import os

import tokenizers

from mp_data.tokenizers.base import BackedTokenizer, check_ids, read_file

__all__ = ["HuggingFaceTokenizer"]

ROLE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Read in this order, a later file's role overriding an earlier one's."""

END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""eod when no role file names an eos_token: the first of these in the vocabulary."""


class HuggingFaceTokenizer(BackedTokenizer):
    """Megatron's HuggingFaceTokenizer, from a local tokenizer.json (file or folder)."""

    add_special_tokens = True

    def __init__(self, path: str | os.PathLike, special_tokens_as_text: bool = False) -> None:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self.path = path
        contents = [("tokenizer.json", read_file(path, "tokenizer.json of HuggingFaceTokenizer"))]
        try:
            backend = tokenizers.Tokenizer.from_str(contents[0][1].decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{path}: not a Hugging Face tokenizer.json: {e}") from e
        self._set_backend(backend, special_tokens_as_text)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        folder = os.path.dirname(path)
        roles: dict[str, tuple[str, str]] = {}  # role -> (token, file naming it)
        for name in ROLE_FILES:
            role_file = os.path.join(folder, name)
            if os.path.isfile(role_file):
                data = read_file(role_file, f"{name} of HuggingFaceTokenizer")
                contents.append((name, data))
                roles.update(_roles(role_file, data))
        ids = {role: self._id(token, role, where) for role, (token, where) in roles.items()}
        self.eod = ids.get("eos_token", self._first_present(END_OF_TEXT))
        self.bos = ids.get("bos_token")
        padding = self.backend.padding
        self.pad = ids.get("pad_token", padding["pad_id"] if padding else None)
        self.identity = self._identity("HuggingFaceTokenizer", contents)

    def detokenize(self, ids) -> str:
        ids = check_ids(ids, self.vocab_size, "HuggingFaceTokenizer")
        return self.backend.decode(ids, skip_special_tokens=False)

    def _id(self, token: str, role: str, where: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"{where}: {role} {token!r} is not in the vocabulary of {self.path}")
        return i

    def _first_present(self, tokens: tuple[str, ...]) -> int | None:
        for token in tokens:
            i = self.backend.token_to_id(token)
            if i is not None:
                return i
        return None


def _roles(path: str, data: bytes) -> dict[str, tuple[str, str]]:
    """The eos/bos/pad tokens a tokenizer_config.json or special_tokens_map.json names."""
    try:
        config = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    found = {}
    for role in ("eos_token", "bos_token", "pad_token"):
        value = config.get(role)
        # transformers writes a token either as its text or as a serialized
        # AddedToken, {"content": text, "lstrip": ..., ...}.
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{path}: {role} must be a token or an AddedToken, got {value!r}")
        found[role] = (value, path)
    return found
