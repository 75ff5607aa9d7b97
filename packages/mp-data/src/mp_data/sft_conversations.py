"""Chat conversations from a JSONL file, checked line by line (Megatron's SFT format).

Each non-blank line is a JSON object whose "messages" is a list of
{"role": ..., "content": ...} objects, roles system, user, assistant or tool,
content a string:

    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4."}]}

As in Megatron-LM's SFTDataset, one line may hold several conversations one
after the other: a system message after the first message starts a new one.
An assistant message answers a user (or tool) message and is not empty
(Megatron's SFTTokenizer asserts both). Whitespace-only lines are skipped, as
`mp-data preprocess` skips them.

A line that breaks a rule raises SFTDataError("FILE:LINE: what is wrong"),
naming the message by its position where one is at fault; nothing is read
past it.
"""

from __future__ import annotations

from collections.abc import Iterator

from mp_data.json_lines import describe_json, json_object

__all__ = ["ROLES", "SFTDataError", "read_conversations", "split_conversations"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (Megatron's SFTTokenizer masks all but assistant)."""

Message = dict
Conversation = list[Message]


class SFTDataError(ValueError):
    """A malformed line of an SFT JSONL file; the message is "FILE:LINE: what is wrong"."""


def read_conversations(path: str) -> Iterator[tuple[int, list[Conversation]]]:
    """(line number, the line's conversations) for each non-blank line of `path`."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed by the with below; open errors named)
    except OSError as error:
        raise FileNotFoundError(f"{path}: cannot read the SFT data ({error.strerror})") from None
    with f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                messages = _messages(json_object(raw.rstrip(b"\r\n")))
            except ValueError as error:
                raise SFTDataError(f"{path}:{number}: {error}") from None
            yield number, split_conversations(messages)


def _messages(record: dict) -> list[Message]:
    """The checked "messages" of one line's object; a ValueError says what is wrong."""
    if "messages" not in record:
        raise ValueError(f"no 'messages' key (keys: {', '.join(sorted(record)) or 'none'})")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be an array, got {describe_json(messages)}")
    if not messages:
        raise ValueError("'messages' is empty")
    for i, message in enumerate(messages):
        where = f"message {i}"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object, got {describe_json(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where} has no {key!r}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"{where} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where} ({role}) has {describe_json(content)} as content; "
                             "content must be a string")  # fmt: skip
        if role == "assistant":
            previous = messages[i - 1]["role"] if i else None
            if previous not in ("user", "tool"):
                raise ValueError(f"{where} (assistant) follows {previous or 'nothing'}; an "
                                 "assistant message answers a user or tool message")  # fmt: skip
            if not content.strip():
                raise ValueError(f"{where} (assistant) is empty")
    return messages


def split_conversations(messages: list[Message]) -> list[Conversation]:
    """Megatron's rule: each system message after the first message starts a conversation."""
    conversations: list[Conversation] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations
