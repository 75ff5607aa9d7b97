"""One line of a JSONL input as a JSON object, or a ValueError saying what is wrong.

Shared by `mp-data preprocess` (cli/encode.py) and the SFT reader
(sft_conversations.py); each caller adds the file and line number.
"""

from __future__ import annotations

import json

__all__ = ["describe_json", "json_object"]


def json_object(raw: bytes) -> dict:
    """The object of one line (`raw`, without its newline): UTF-8 text, JSON, an object."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 text (byte {e.start + 1}: {raw[e.start : e.start + 1]!r})"
        ) from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {describe_json(record)}")
    return record


def describe_json(value) -> str:
    """A JSON value's kind, in JSON's words."""
    for kind, name in (
        (bool, "true/false"),
        (str, "a string"),
        (dict, "an object"),
        (list, "an array"),
    ):
        if isinstance(value, kind):
            return name
    return "null" if value is None else "a number"
