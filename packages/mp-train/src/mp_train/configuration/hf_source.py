"""A run that starts from a Hugging Face model directory: its settings from config.json.

    hf_source(load, pretrained_checkpoint)    the Hugging Face directory a run starts
                                              from, or None
    apply_hf_settings(values, explicit)       the model's fields from that directory's
                                              config.json (parse_config calls it)
    hf_differences(config, settings)          the run's fields that disagree with them

`--load DIR` or `--pretrained-checkpoint DIR` may name a Hugging Face directory
(mp_ckpt.is_hf_directory: a config.json with a model_type, no mp tracker). Its
config.json gives the model's settings as `mp-ckpt import-hf` derives them
(mp_ckpt.hf_directory_settings): a field the user did not give takes the directory's
value; one given with another value is refused, every such field named, since the
weights could not be loaded into that model. The run's own choices (dropouts,
precision, recomputation, initialization std) are taken when not given and never
refused. The vocabulary: padded_vocab_size is the embedding's rows in the weights
(given otherwise: refused), and the tokenizer is the directory's tokenizer.json
(HuggingFaceTokenizer) unless the user named a tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mp_ckpt import hf_directory_settings, is_hf_directory
from mp_train.configuration.yaml_config import field_types, run_parts

__all__ = [
    "apply_hf_settings",
    "hf_differences",
    "hf_source",
    "is_directory_tokenizer",
    "model_fields_of",
]

RUN_CHOICES = frozenset({
    "bf16", "fp16", "params_dtype", "hidden_dropout", "attention_dropout", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "init_method_std",
})  # fmt: skip
"""Model fields that say how this run trains, not which model it loads: taken from the
directory when not given, never refused."""


def hf_source(load: str | None, pretrained_checkpoint: str | None) -> str | None:
    """The Hugging Face directory whose settings the run's model has: load when it is
    one, else pretrained_checkpoint when it is one (a resumed fine-tuning run keeps the
    settings of the directory it started from)."""
    for path in (load, pretrained_checkpoint):
        if is_hf_directory(path):
            return str(path)
    return None


def model_fields_of(settings: dict) -> dict[tuple[str, str], Any]:
    """{(part, field): value} of an imported model's settings (Megatron's names) in the
    RunConfig's parts: the model's fields, max_position_embeddings, and the vocabulary
    rows as padded_vocab_size. Settings no field of this version has are left out."""
    model_types = field_types(run_parts()["model"])
    fields: dict[tuple[str, str], Any] = {}
    for name, value in settings.items():
        if name == "vocab_size":
            fields["data", "padded_vocab_size"] = value
        elif name == "max_position_embeddings":
            fields["gpt", name] = value
        elif name in model_types:
            fields["model", name] = model_types[name].convert(value)
    return fields


def apply_hf_settings(values: dict, explicit: set[tuple[str, str]]) -> None:
    """Sets in `values` (part -> field -> value) the settings of the Hugging Face
    directory the run starts from, if any (module docstring); `explicit`: the (part,
    field) pairs the user gave. Raises a ValueError naming every field that disagrees."""
    checkpoint = values["checkpoint"]
    path = hf_source(checkpoint.get("load"), checkpoint.get("pretrained_checkpoint"))
    if path is None:
        return
    settings = _with_mp_defaults(hf_directory_settings(path)[1])
    differing = []
    for (part, name), value in model_fields_of(settings).items():
        if (part, name) not in explicit or name in RUN_CHOICES:
            if (part, name) not in explicit:
                values[part][name] = value
            continue
        if values[part].get(name) != value:
            differing.append(f"{name}: {path}/config.json {value!r}, given "
                             f"{values[part].get(name)!r}")  # fmt: skip
    if differing:
        raise ValueError(
            f"the model given differs from the Hugging Face model at {path} (drop these "
            "settings: they are taken from its config.json):\n  " + "\n  ".join(differing)
        )
    rows, tp = settings["vocab_size"], values["parallel"].get("tensor_model_parallel_size", 1)
    if rows % tp:
        raise ValueError(
            f"the Hugging Face model at {path} has {rows} embedding rows, not divisible by "
            f"tensor_model_parallel_size={tp}: each tensor-parallel rank holds an equal slice "
            "of them"
        )
    data = values["data"]
    if "tokenizer_type" in data or "vocab_size" in data:
        return
    if not (Path(path) / "tokenizer.json").is_file():
        raise ValueError(
            f"{path} holds no tokenizer.json: name the tokenizer (--tokenizer-type, "
            "--tokenizer-model)"
        )
    data["tokenizer_type"] = "HuggingFaceTokenizer"
    data["tokenizer_model"] = path


def _with_mp_defaults(settings: dict) -> dict:
    """A Hugging Face model's settings with what none of its families has said outright:
    no muP (its logits, embedding and attention have no muP multipliers)."""
    return {"use_mup": False} | settings


def hf_differences(config, settings: dict) -> list[str]:
    """The fields of a RunConfig that differ from a Hugging Face directory's settings
    (the run's own choices aside), as `field: directory's, run's` lines."""
    differing = []
    for (part, name), value in model_fields_of(_with_mp_defaults(settings)).items():
        if name in RUN_CHOICES or (part, name) == ("data", "padded_vocab_size"):
            continue
        have = getattr(getattr(config, part), name)
        if have != value:
            differing.append(f"{name}: Hugging Face {value!r}, this run {have!r}")
    return differing


def is_directory_tokenizer(data, path: str | os.PathLike) -> bool:
    """Whether the run's tokenizer is the tokenizer.json of the directory at `path`."""
    if data.tokenizer_type != "HuggingFaceTokenizer" or data.tokenizer_model is None:
        return False
    model = Path(data.tokenizer_model)
    model = model if model.is_dir() else model.parent
    return model.resolve() == Path(path).resolve()
