"""The tokenizer and generation settings that travel with a model to and from Hugging Face.

An imported checkpoint keeps, in common.pt, the source folder's tokenizer
files (their bytes: tokenizer.json, tokenizer_config.json, vocab.json, ...)
and its bos / eos / pad ids, under common["tokenizer"], and its
generation_config.json under common["generation_config"]:

    common["tokenizer"] = {"files": {"tokenizer.json": b"...", ...},
                           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}

A checkpoint saved by mp's training names its tokenizer in the run's data
config (common["config"]["data"]: tokenizer_type and the files' paths); the
export reads GPT2BPETokenizer's vocab.json / merges.txt and
HuggingFaceTokenizer's tokenizer.json (with the role files beside it) from
those paths, and writes the tokenizer_config.json transformers' AutoTokenizer
needs where the files have none. Other tokenizer types have no Hugging Face
files: the export then carries none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = [
    "TOKENIZER_FILES",
    "export_tokenizer",
    "generation_config",
    "tokenizer_from_hf",
    "write_atomically",
    "write_tokenizer_files",
]

_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where transformers 5 keeps a tokenizer's chat template, beside tokenizer_config.json."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   *_TEMPLATE_FILES)  # fmt: skip
"""The files of a Hugging Face folder that make up its tokenizer (those present are kept)."""

_ROLE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_from_hf(hf_dir: Path, config: dict, generation: dict | None) -> dict:
    """common["tokenizer"] for a Hugging Face folder: its tokenizer files and the special
    token ids of its config.json (generation_config.json's where config.json has none)."""
    files = {name: (hf_dir / name).read_bytes() for name in TOKENIZER_FILES
             if (hf_dir / name).is_file()}  # fmt: skip
    record: dict = {"files": files}
    for key in _ID_KEYS:
        record[key] = config.get(key)
        if record[key] is None and generation is not None:
            record[key] = generation.get(key)
    return record


def export_tokenizer(common: dict) -> tuple[dict[str, bytes], dict]:
    """(tokenizer files by name, special token ids) of a checkpoint's common.pt."""
    record = common.get("tokenizer")
    if isinstance(record, dict):
        return dict(record.get("files", {})), {k: record.get(k) for k in _ID_KEYS}
    data = (common.get("config") or {}).get("data") or {}
    kind = data.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        return _gpt2_bpe_files(data)
    if kind == "HuggingFaceTokenizer":
        return _huggingface_files(data)
    return {}, {}


def _read(data: dict, field: str, what: str) -> bytes:
    path = data.get(field)
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(
            f"the checkpoint's data config {field}={path!r} ({what}) is not a file here; "
            "the tokenizer cannot be exported"
        )
    return Path(path).read_bytes()


def _gpt2_bpe_files(data: dict) -> tuple[dict[str, bytes], dict]:
    vocab = _read(data, "vocab_file", "GPT2BPETokenizer's vocab.json")
    merges = _read(data, "merge_file", "GPT2BPETokenizer's merges.txt")
    eod = json.loads(vocab).get("<|endoftext|>")
    if eod is None:
        raise ValueError(f"{data['vocab_file']}: no <|endoftext|> token, which GPT-2 uses as eod")
    # Megatron's GPT2BPETokenizer: no prefix space, <|endoftext|> as bos, eos and unk.
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>"}  # fmt: skip
    files = {"vocab.json": vocab, "merges.txt": merges,
             "tokenizer_config.json": json.dumps(config, indent=2).encode()}  # fmt: skip
    return files, {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None}


def _huggingface_files(data: dict) -> tuple[dict[str, bytes], dict]:
    path = data.get("tokenizer_model")
    if path and os.path.isdir(path):
        data = data | {"tokenizer_model": os.path.join(path, "tokenizer.json")}
    tokenizer = _read(data, "tokenizer_model", "HuggingFaceTokenizer's tokenizer.json")
    folder = Path(data["tokenizer_model"]).parent
    files = {"tokenizer.json": tokenizer}
    roles: dict[str, str] = {}
    for name in _ROLE_FILES:
        if (folder / name).is_file():
            files[name] = (folder / name).read_bytes()
            roles.update(_roles(json.loads(files[name])))
    for name in _TEMPLATE_FILES:  # a chat template goes with the tokenizer
        if (folder / name).is_file():
            files[name] = (folder / name).read_bytes()
    vocab = _vocabulary(json.loads(tokenizer))
    # mp-data's eod without a role file naming one: the first end-of-text token it knows.
    eos = roles.get("eos_token") or next((t for t in _END_OF_TEXT if t in vocab), None)
    if "tokenizer_config.json" not in files:
        config = {"tokenizer_class": "PreTrainedTokenizerFast"} | roles
        if eos is not None:
            config["eos_token"] = eos
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    ids = {"bos_token_id": vocab.get(roles.get("bos_token")), "eos_token_id": vocab.get(eos),
           "pad_token_id": vocab.get(roles.get("pad_token"))}  # fmt: skip
    return files, ids


def _roles(config: dict) -> dict[str, str]:
    """{"bos_token": "<s>", ...} of a tokenizer_config.json / special_tokens_map.json."""
    roles = {}
    for role in ("bos_token", "eos_token", "pad_token"):
        token = config.get(role)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            roles[role] = token
    return roles


def _vocabulary(tokenizer: dict) -> dict[str, int]:
    """Token -> id of a tokenizer.json: its model's vocabulary and its added tokens."""
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    return dict(vocab) | {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}


def generation_config(common: dict, ids: dict) -> dict | None:
    """The generation_config.json to write: the imported one, else the special token ids
    (None when none is known)."""
    saved = common.get("generation_config")
    if isinstance(saved, dict):
        return saved
    known = {k: v for k, v in ids.items() if v is not None}
    return known or None


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `path` under a temporary name and renames it into place once complete."""
    tmp = path.with_name(f".mp-ckpt-export-{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tokenizer_files(common: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Writes a checkpoint's tokenizer files (export_tokenizer) into out_dir; returns them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, _ = export_tokenizer(common)
    written = []
    for name, data in files.items():
        if name not in TOKENIZER_FILES:
            raise ValueError(f"common['tokenizer'] names a file {name!r}, not a tokenizer file")
        write_atomically(out / name, data)
        written.append(out / name)
    return written
