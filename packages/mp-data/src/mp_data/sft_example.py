"""A chat tokenizer and a chat corpus with no download, for demonstrations and tests.

`write_chat_tokenizer(folder)` writes a word-level tokenizer.json (words split
on whitespace and punctuation) and a tokenizer_config.json holding a
ChatML-style chat template:

    <|im_start|>user
    u3 u17<|im_end|>
    <|im_start|>assistant
    a17 a3<|im_end|>

`write_chat_corpus(path, n)` writes n conversations as SFT JSONL lines. Words
say whose they are: the system message opens with the conversation's tag
c<i>, users speak u<k>, assistants a<k> (the user's words mirrored, so there
is something to learn), which lets a test find every conversation and every
assistant token in a packed sample without the code under test.

    python -m mp_data.sft_example DIR [N]   # DIR/tokenizer/, DIR/chat.jsonl
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

__all__ = ["CHAT_TEMPLATE", "write_chat_corpus", "write_chat_tokenizer"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
WORDS = 50
"""Users' words u0..u49, assistants' a0..a49, systems' s0..s9."""
TAGS = 1000
"""Conversation tags c0..c999 (a corpus of more conversations reuses them)."""


def write_chat_tokenizer(folder: str) -> str:
    """Writes folder/tokenizer.json and tokenizer_config.json; returns folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["system", "user", "assistant", "tool", "[UNK]"]
    words += [f"{kind}{i}" for kind, n in (("u", WORDS), ("a", WORDS), ("s", 10)) for i in range(n)]
    words += [f"c{i}" for i in range(TAGS)]
    vocab = {w: i for i, w in enumerate([*SPECIAL, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL))
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return folder


def write_chat_corpus(path: str, n: int, seed: int = 0, long_every: int = 0,
                      long_words: int = 100) -> list[dict]:  # fmt: skip
    """Writes n conversations (one a line) to `path` and returns the records. Each has a
    system message and 1 to 3 user/assistant turns of 1 to 8 words; with long_every=k,
    every k-th conversation's first user message has long_words words instead."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        system = " ".join([f"c{i % TAGS}", *(f"s{k}" for k in rng.integers(0, 10, 2))])
        messages = [{"role": "system", "content": system}]
        for turn in range(int(rng.integers(1, 4))):
            count = long_words if long_every and i % long_every == 0 and turn == 0 else None
            said = rng.integers(0, WORDS, count or int(rng.integers(1, 9)))
            messages.append({"role": "user", "content": " ".join(f"u{k}" for k in said)})
            answer = " ".join(f"a{k}" for k in said[::-1][:8])
            messages.append({"role": "assistant", "content": answer})
        records.append({"messages": messages})
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return records


if __name__ == "__main__":
    out = sys.argv[1]
    write_chat_tokenizer(os.path.join(out, "tokenizer"))
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    write_chat_corpus(os.path.join(out, "chat.jsonl"), count)
    print(f"{out}/tokenizer/ and {out}/chat.jsonl ({count} conversations)")
