"""The run's fields by name, plain values converted to them, and YAML files in Megatron-LM's
layout.

    language_model:            # TransformerConfig fields (and seq_length, ...)
      num_layers: 24
      hidden_size: 1024
    model_parallel:            # ParallelConfig fields
      tensor_model_parallel_size: 2
    micro_batch_size: 4        # any other field, top level, by name
    save: ${RUN_DIR}/ckpt      # ${VAR} or ${VAR:default} from the environment

Field names are unique across the run's parts (except SHARED_FIELDS: bf16,
fp16 and params_dtype set every part having them), so a key is looked up by
name wherever it stands; the sections keep Megatron's files loading as they
are. Every error names the file, the line and the key.

FieldType converts a plain value (a YAML scalar, a command-line word, a
value saved in a checkpoint) to what a field holds: int, float, str, bool,
torch.dtype (fp32 / bf16 / fp16), an Enum, a Literal's choices, a list of
them, or None; a tuple of n of them (tuple[int, int], one word "127,0"); or one
value or a list (int | list[int], one word: "2", "1,1,0" or Megatron's pattern
"[1,1,0]*3").
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from mp_train.configuration.config import RunConfig
from mp_train.configuration.int_lists import parse_int_list, parse_int_or_list
from mp_train.configuration.megatron_flag_names import MEGATRON_FLAGS

__all__ = [
    "DTYPE_NAMES",
    "SECTIONS",
    "SHARED_FIELDS",
    "FieldType",
    "field_owners",
    "field_types",
    "load_yaml_config",
    "run_parts",
]

SECTIONS = ("language_model", "model_parallel")
"""Megatron's section keys; their entries are fields like the top-level ones."""

SHARED_FIELDS = frozenset({"bf16", "fp16", "params_dtype"})
"""Names that live in several parts on purpose (model and optimizer): setting one sets all."""

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}  # fmt: skip
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


# --- the run's fields and their types -----------------------------------------------


@dataclass(frozen=True)
class FieldType:
    """What a field holds, as far as the command line and YAML need to know: one of
    int, float, str, bool, torch.dtype, an Enum or a Literal's choices, maybe a list of
    them (`many`), maybe None (`optional`)."""

    base: Any
    optional: bool = False
    many: bool = False
    choices: tuple = ()
    length: int = 0
    """n for a tuple of n values (tuple[int, int]), else 0."""
    one_or_many: bool = False
    """A value or a list of them (int | list[int]), given as one word."""

    @classmethod
    def of(cls, hint: Any) -> FieldType:
        """The FieldType of a resolved annotation; TypeError for one with no mapping."""
        hint, optional, many = _strip_annotated(hint), False, False
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            args = [_strip_annotated(a) for a in typing.get_args(hint) if a is not type(None)]
            optional = len(args) < len(typing.get_args(hint))
            scalars = [a for a in args if typing.get_origin(a) is not list]
            if len(args) == 2 and len(scalars) == 1 and list[scalars[0]] in args:
                return dataclasses.replace(cls.of(scalars[0]), optional=optional, one_or_many=True)
            if len(args) != 1:
                raise TypeError(
                    f"{hint} is a union of several types; only T | None and T | list[T] map"
                )
            hint = args[0]
        if typing.get_origin(hint) is tuple:
            items = typing.get_args(hint)
            if not items or Ellipsis in items or len(set(items)) != 1:
                raise TypeError(f"{hint}: only tuples of n values of one type map")
            return dataclasses.replace(cls.of(items[0]), optional=optional, length=len(items))
        if typing.get_origin(hint) is list:
            (hint,), many = typing.get_args(hint), True
            hint = _strip_annotated(hint)
        if typing.get_origin(hint) is Literal:
            choices = typing.get_args(hint)
            kinds = {type(c) for c in choices}
            if len(kinds) != 1 or not kinds <= {str, int}:
                raise TypeError(f"{hint}: only Literals of all-str or all-int values map")
            return cls(kinds.pop(), optional, many, choices)
        is_enum = inspect.isclass(hint) and issubclass(hint, enum.Enum)
        if hint in (int, float, str, bool) or hint is torch.dtype or is_enum:
            return cls(hint, optional, many)
        raise TypeError(f"{hint!r} has no command-line mapping")

    def convert(self, value: Any) -> Any:
        """The field's value from a plain one (a YAML scalar or list, a checkpoint's saved
        value, a command-line string); ValueError saying what is wrong."""
        if value is None:
            if self.optional:
                return None
            raise ValueError("null is not allowed here")
        if self.many:
            if self.takes_int_lists and isinstance(value, str):
                return parse_int_list(value)
            items = value if isinstance(value, list | tuple) else [value]
            return [self.element(item) for item in items]
        if self.optional and _is_null_text(value) and value not in self.choices:
            return None
        if self.length:
            items = _words(value) if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or len(items) != self.length:
                raise ValueError(f"{value!r} is not {self.length} values (e.g. 127,0)")
            return tuple(self.element(item) for item in items)
        if self.one_or_many:
            if isinstance(value, str) and "[" in value:
                value = parse_int_or_list(value)  # Megatron's "[1,1,0]*3"
            elif isinstance(value, str) and "," in value:
                value = _words(value)
            if isinstance(value, list | tuple):
                return [self.element(item) for item in value]
        return self.element(value)

    def element(self, value: Any) -> Any:
        """One value (a list's item) converted to the base type."""
        if self.choices:
            if isinstance(value, str) and self.base is int:
                value = _to_int(value)
            if value not in self.choices:
                raise ValueError(f"{value!r} is not one of {', '.join(map(str, self.choices))}")
            return value
        if self.base is bool:
            return _to_bool(value)
        if self.base is int:
            return _to_int(value)
        if self.base is float:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError(f"{value!r} is not a number")
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a number") from None
        if self.base is str:
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise ValueError(f"{value!r} is not a string")
            return str(value)
        if self.base is torch.dtype:
            return _to_dtype(value)
        return _to_enum(self.base, value)

    def convert_word(self, word: str) -> Any:
        """One command-line word (argparse converts a list's words one by one)."""
        return self.element(word) if self.many else self.convert(word)

    def convert_int_list_word(self, word: str) -> list[int]:
        """One command-line word of a list-of-integers field (`takes_int_lists`): its
        integers, an integer or a Megatron list expression; the option's value is the
        words' lists joined."""
        return parse_int_list(word)

    @property
    def takes_int_lists(self) -> bool:
        """A list of integers (moe_layer_freq): a command-line word, and a YAML string, may
        be Megatron-LM's list expression ("([0]+[1]*26)", read by
        mp_train.configuration.int_lists)."""
        return self.many and self.base is int and not self.choices

    def words(self) -> list[str] | None:
        """The accepted words of a field with a closed set of values, else None."""
        if self.choices:
            return [str(c) for c in self.choices]
        if self.base is torch.dtype:
            return list(DTYPE_NAMES.values())
        if inspect.isclass(self.base) and issubclass(self.base, enum.Enum):
            return [member.name for member in self.base]
        return None

    @staticmethod
    def show(value: Any) -> str:
        """A value as the command line writes it (dtypes as fp32, bf16, ...)."""
        if isinstance(value, torch.dtype):
            return DTYPE_NAMES.get(value, str(value))
        if isinstance(value, enum.Enum):
            return value.name
        if isinstance(value, list | tuple):
            return " ".join(FieldType.show(v) for v in value)
        return str(value)


def _words(text: str) -> list[str]:
    """ "127,0" or "(127, 0)" -> ["127", "0"]."""
    return [w.strip() for w in text.strip().strip("()[]").split(",")]


def _strip_annotated(hint: Any) -> Any:
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint


def _is_null_text(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("none", "null")


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{value!r} is not a boolean (true or false)")


def _to_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:  # 1e6 and 2.0 are integers too
            number = float(value)
        except ValueError:
            number = None
        if number is not None and number.is_integer():
            return int(number)
    raise ValueError(f"{value!r} is not an integer")


def _to_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
    raise ValueError(f"{value!r} is not a dtype: use one of {', '.join(_DTYPES)}")


def _to_enum(kind: type[enum.Enum], value: Any) -> enum.Enum:
    if isinstance(value, kind):
        return value
    for member in kind:
        if value in (member.name, member.value) or (
            isinstance(value, str) and value == str(member.value)
        ):
            return member
    words = ", ".join(member.name for member in kind)
    raise ValueError(f"{value!r} is not one of {words}")


@functools.cache
def field_types(cls: type) -> dict[str, FieldType]:
    """Every init field of dataclass `cls` -> its FieldType. Annotations written as strings
    (`from __future__ import annotations`) are resolved in the defining module."""
    hints = typing.get_type_hints(cls, include_extras=True)
    result = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        try:
            result[f.name] = FieldType.of(hints[f.name])
        except TypeError as error:
            raise TypeError(f"{cls.__name__}.{f.name}: {error}") from None
    return result


def run_parts() -> dict[str, type]:
    """RunConfig's part names -> their dataclasses (resolved), in order."""
    return typing.get_type_hints(RunConfig)


@functools.cache
def field_owners() -> dict[str, tuple[str, ...]]:
    """Field name -> the RunConfig parts that have it. A name in several parts must be one
    of SHARED_FIELDS: another would make `--name` and a YAML key ambiguous."""
    owners: dict[str, list[str]] = {}
    for part, cls in run_parts().items():
        for name in field_types(cls):
            owners.setdefault(name, []).append(part)
    for name, parts in owners.items():
        if len(parts) > 1 and name not in SHARED_FIELDS:
            raise ValueError(
                f"field {name!r} is defined in several parts ({', '.join(parts)}) but is not "
                f"one of the shared fields ({', '.join(sorted(SHARED_FIELDS))})"
            )
    return {name: tuple(parts) for name, parts in owners.items()}


# --- YAML files ---------------------------------------------------------------------


def load_yaml_config(
    path: str | os.PathLike, environ: Mapping[str, str] = os.environ
) -> dict[str, dict[str, Any]]:
    """Part name -> field -> value (converted to the field's type) for every RunConfig part
    (empty where the file sets nothing). ValueError for bad input."""
    path = Path(path)
    loader = yaml.SafeLoader(path.read_text())
    try:
        root = loader.get_single_node()
        entries = list(_entries(path, loader, root))
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    finally:
        loader.dispose()

    kinds = {part: field_types(cls) for part, cls in run_parts().items()}
    owners = field_owners()
    settings: dict[str, dict[str, Any]] = {part: {} for part in kinds}
    seen: dict[str, int] = {}
    for key, line, value in entries:
        where = f"{path}:{line}: {key}"
        name = key.rpartition(".")[2]
        if name not in owners:
            close = difflib.get_close_matches(name, owners, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            if f"--{name.replace('_', '-')}" in MEGATRON_FLAGS:
                hint = " (a Megatron-LM setting that mp does not implement)"
            raise ValueError(f"{where}: unknown key: no part of the run has a field {name!r}{hint}")
        if name in seen:
            raise ValueError(f"{where}: {name} is set twice (first at line {seen[name]})")
        seen[name] = line
        value = _substitute(value, environ, where)
        for part in owners[name]:
            try:
                settings[part][name] = kinds[part][name].convert(value)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
    return settings


def _entries(path: Path, loader: yaml.SafeLoader, root: yaml.Node | None):
    """(key, line, value) for each setting: top-level ones and those of the sections
    (as section.key)."""
    if root is None:  # an empty file
        return
    _require_mapping(path, root, "the file")
    for key_node, value_node in root.value:
        key = key_node.value
        if key in SECTIONS:
            if isinstance(value_node, yaml.ScalarNode) and value_node.tag.endswith(":null"):
                continue  # an empty section
            _require_mapping(path, value_node, f"section {key}")
            for sub_key, sub_value in value_node.value:
                yield (f"{key}.{sub_key.value}", sub_key.start_mark.line + 1,
                       loader.construct_object(sub_value, deep=True))  # fmt: skip
        else:
            yield key, key_node.start_mark.line + 1, loader.construct_object(value_node, deep=True)


def _require_mapping(path: Path, node: yaml.Node, what: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        raise ValueError(f"{path}:{node.start_mark.line + 1}: {what} must be a mapping of keys")


def _substitute(value: Any, environ: Mapping[str, str], where: str) -> Any:
    """${VAR} and ${VAR:default} replaced in a string (or a list's strings)."""
    if isinstance(value, list):
        return [_substitute(item, environ, where) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ValueError(
            f"{where}: environment variable {name} is not set (write ${{{name}:default}} "
            "to give a default)"
        )

    return _REFERENCE.sub(replace, value)
