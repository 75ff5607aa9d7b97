"""The command line of a run: one option per field of the RunConfig dataclasses.

    pretrain_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
        --config run.yaml --bf16 --micro-batch-size 4 ...

Each dataclass field becomes `--field-name`; its type picks the option's kind (a
value, a `--x` / `--no-x` flag, a list, a choice) and the docstring under the field
is its help. A field may adjust its option with `metadata={"argparse_meta": {...}}`
(keys: names, type, nargs, default, choices, help; negatives: a flag's other
spellings for False). Options are absent from the parsed namespace unless given, so
the command line overrides a YAML file (`--config`) only where it says something.
Precedence: dataclass default < argparse_meta default < YAML < command line (< the
checkpoint's model settings with --use-checkpoint-args). A Hugging Face directory at
--load / --pretrained-checkpoint fills the model fields not given and refuses those
given otherwise (hf_source.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mp_layers import split_hybrid_pattern
from mp_train.configuration import megatron_aliases, megatron_flags
from mp_train.configuration.checkpoint_args import apply_checkpoint_args
from mp_train.configuration.config import RunConfig
from mp_train.configuration.hf_source import apply_hf_settings
from mp_train.configuration.megatron_flag_names import MEGATRON_FLAGS
from mp_train.configuration.pipeline_segments import derive_virtual_stages
from mp_train.configuration.yaml_config import (
    FieldType,
    field_owners,
    field_types,
    load_yaml_config,
    run_parts,
)
from mp_train.errors import ConfigError

__all__ = ["ArgumentGroupFactory", "build_parser", "field_docs", "parse_config"]

_METAVARS = {int: "N", float: "X"}


# --- help texts ---------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in the class body (base classes included),
    whitespace collapsed. A class whose source cannot be read has none."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = _class_node(klass)
        if node is None:
            continue
        for statement, following in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _class_node(klass: type) -> ast.ClassDef | None:
    """The class statement of a class defined at the top of a readable source file."""
    try:
        path = inspect.getsourcefile(klass)
        return _top_level_classes(path).get(klass.__qualname__) if path else None
    except (OSError, TypeError):  # a builtin (object), or no file to read
        return None


@functools.cache
def _top_level_classes(path: str) -> dict[str, ast.ClassDef]:
    """A source file's top-level class statements by name: each file parsed once (the
    config classes share a few files; inspect.getsource would search a file per class)."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


# --- options from a dataclass -----------------------------------------------------------


class _FlagAction(argparse.Action):
    """`--x` sets True, `--no-x` sets False."""

    def __init__(self, option_strings, dest, negatives=(), **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.negatives = frozenset(negatives)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _IntListsAction(argparse.Action):
    """A list-of-integers option: each word converts to a list (an integer or a Megatron
    list expression); the option's value is their concatenation."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, [item for value in values for item in value])


class ArgumentGroupFactory:
    """Adds one option per field of a dataclass to an argparse parser.

    Arguments:
        dataclass_type: the dataclass.
        exclude: fields to leave out.
        name_map: field name -> the option's main name (`--name`) instead of `--field-name`.

    The option's dest is the field name; its argparse default is SUPPRESS, so the parsed
    namespace holds only the options given. `values(namespace)` returns the field values
    they set (with argparse_meta defaults beneath them).
    """

    def __init__(self, dataclass_type: type, exclude: Sequence[str] = (),
                 name_map: Mapping[str, str] | None = None) -> None:  # fmt: skip
        if not dataclasses.is_dataclass(dataclass_type):
            raise TypeError(f"{dataclass_type!r} is not a dataclass")
        self.dataclass_type = dataclass_type
        self.exclude = frozenset(exclude)
        self.name_map = dict(name_map or {})
        types_ = field_types(dataclass_type)
        unknown = (self.exclude | set(self.name_map)) - set(types_)
        if unknown:
            raise ValueError(
                f"{dataclass_type.__name__} has no field(s) {', '.join(sorted(unknown))}"
            )
        self.fields = [
            f for f in dataclasses.fields(dataclass_type) if f.init and f.name not in self.exclude
        ]
        self.types = {f.name: types_[f.name] for f in self.fields}
        self.defaults = {f.name: _meta(f)["default"] for f in self.fields if "default" in _meta(f)}
        self.actions: dict[str, argparse.Action] = {}

    def build_group(self, parser: argparse.ArgumentParser, title: str,
                    description: str | None = None) -> argparse._ArgumentGroup:  # fmt: skip
        """Adds the options, in field order, to a new group of `parser`."""
        group = parser.add_argument_group(title, description)
        docs = field_docs(self.dataclass_type)
        for f in self.fields:
            self.actions[f.name] = self._add(group, f, docs.get(f.name, ""))
        return group

    def values(self, namespace: argparse.Namespace) -> dict[str, Any]:
        """Field -> value: argparse_meta defaults, then the options given."""
        given = vars(namespace)
        return {**self.defaults, **{n: given[n] for n in self.types if n in given}}

    def _add(self, group, f: dataclasses.Field, doc: str) -> argparse.Action:
        kind, meta = self.types[f.name], _meta(f)
        main = self.name_map.get(f.name, f.name.replace("_", "-"))
        main = main if main.startswith("-") else f"--{main}"
        names = [main, *meta.get("names", ())]
        default = meta.get("default", _default(f))
        help_text = meta.get("help", doc)
        shown = (
            "required" if default is dataclasses.MISSING else f"default: {FieldType.show(default)}"
        )
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": f"{help_text} ({shown})".lstrip().replace("%", "%%"),
        }
        if kind.base is bool and not kind.many and "type" not in meta and "nargs" not in meta:
            negative = "--no-" + main.lstrip("-")
            # A field named no_x (Megatron's --no-save-optim) gets no --no-no-x.
            negatives = [] if f.name.startswith("no_") else [negative]
            negatives += meta.get("negatives", ())  # Megatron's --disable-x beside --no-x
            return group.add_argument(*names, *negatives, action=_FlagAction,
                                      negatives=negatives, **kwargs)  # fmt: skip
        kwargs["type"] = meta.get("type") or _word_parser(kind)
        if kind.takes_int_lists and not meta.keys() & {"type", "nargs"}:
            kwargs["type"] = _word_parser(kind, kind.convert_int_list_word)
            kwargs["action"] = _IntListsAction
        if kind.many or "nargs" in meta:
            kwargs["nargs"] = meta.get("nargs", "+")
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        else:
            words = kind.words()
            metavar = _METAVARS.get(kind.base, f.name.upper())
            if kind.length:  # one word "127,0"
                metavar = ",".join([metavar] * kind.length)
            elif kind.one_or_many:  # one word "2", "1,1,0" or "[1,1,0]*3"
                metavar = f"{metavar}|LIST"
            kwargs["metavar"] = "{" + ",".join(words) + "}" if words else metavar
        return group.add_argument(*names, **kwargs)


def _word_parser(kind: FieldType, convert=None):
    """argparse's `type=`: one word converted (by kind.convert_word unless `convert` is
    given), a bad one reported against the option."""

    def parse(word: str) -> Any:
        try:
            return (convert or kind.convert_word)(word)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _meta(f: dataclasses.Field) -> dict[str, Any]:
    return f.metadata.get("argparse_meta", {})


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# --- the run's parser -------------------------------------------------------------------

_SECTIONS = {"model": "language_model:", "parallel": "model_parallel:"}


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """The run's parser: a group of options per RunConfig part, `--config` and Megatron-LM's
    alias flags."""
    return _build(prog)[0]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that, with `raise_errors`, raises a ConfigError for a bad option
    instead of printing the usage and exiting (on every rank)."""

    raise_errors = False

    def error(self, message: str):
        if self.raise_errors:
            raise ConfigError(f"{message} (see {self.prog} --help)")
        super().error(message)


def _build(prog: str) -> tuple[argparse.ArgumentParser, dict[str, ArgumentGroupFactory]]:
    owners = field_owners()
    parser = _Parser(
        prog=prog, allow_abbrev=False, usage="%(prog)s [--config PATH] [options]",
        description="Pretrain a GPT model. Options override the --config YAML file.",
    )  # fmt: skip
    parser.add_argument(
        "--config", "--yaml-cfg", dest="config", default=argparse.SUPPRESS, metavar="PATH",
        help="A YAML file in Megatron-LM's layout (language_model:, model_parallel:, then "
        "fields by name); ${VAR} and ${VAR:default} are read from the environment.",
    )  # fmt: skip
    factories = {}
    for part, cls in run_parts().items():
        # A shared name gets its option in the first part that has it.
        taken = [name for name in field_types(cls) if owners[name][0] != part]
        factories[part] = ArgumentGroupFactory(cls, exclude=taken)
        where = f"section {_SECTIONS[part]}" if part in _SECTIONS else "top-level fields"
        description = f"{cls.__name__} ({cls.__module__.split('.')[0]}); in YAML: {where}"
        factories[part].build_group(parser, part, description)
    for name, parts in owners.items():
        if len(parts) > 1:
            action = factories[parts[0]].actions[name]
            action.help = f"{action.help} Sets {' and '.join(f'{p}.{name}' for p in parts)}."
    megatron_aliases.add_to(parser)
    megatron_flags.add_to(parser)
    return parser, factories


def _unknown_message(unknown: list[str]) -> str:
    """argparse's message for options it does not know, naming those that are Megatron-LM
    flags (megatron_flag_names.py) as such: a launch line from Megatron-LM is not a typo."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    megatron = [a.split("=", 1)[0] for a in unknown if a.split("=", 1)[0] in MEGATRON_FLAGS]
    if not megatron:
        return message
    which = "a Megatron-LM flag" if len(megatron) == 1 else "Megatron-LM flags"
    return (
        f"{message} ({', '.join(megatron)}: {which} that mp does not implement; "
        "docs/migrating-from-megatron.md lists the ones it takes)"
    )


def parse_config(
    argv: list[str] | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    prog: str = "pretrain_gpt.py",
    exit_on_error: bool = True,
) -> RunConfig:
    """The RunConfig of a command line (sys.argv[1:] when None). Each part's dataclass
    validates its own fields: its ValueError propagates. A bad option exits via argparse
    (raises a ConfigError with `exit_on_error=False`)."""
    parser, factories = _build(prog)
    parser.raise_errors = not exit_on_error
    argv = megatron_aliases.expand_presets(parser, sys.argv[1:] if argv is None else list(argv))
    namespace, unknown = parser.parse_known_args(argv)
    given = vars(namespace)
    # A refused flag names the feature it needs, which says more than the unknown flags
    # of the same model family.
    megatron_flags.refuse(given)
    if unknown:
        parser.error(_unknown_message(unknown))
    config_path = given.pop("config", None)
    flags = megatron_aliases.take(given)

    values: dict[str, dict[str, Any]] = {part: {} for part in factories}
    defaults: dict[tuple[str, str], Any] = {}
    for factory in factories.values():
        for name, value in factory.defaults.items():
            for owner in field_owners()[name]:
                values[owner][name] = defaults[owner, name] = value
    written = set()
    if config_path is not None:
        for part, settings in load_yaml_config(config_path, environ).items():
            values[part].update(settings)
            written |= {(part, name) for name in settings}
    megatron_aliases.check_virtual_stage_flags(flags, given, values)
    ignored = megatron_flags.apply(given, values)
    written |= {(part, name) for name in given for part in field_owners()[name]}
    notes = [f"Megatron-LM flags accepted without effect: {' '.join(ignored)} (--help says "
             "why each changes nothing here)"] if ignored else []  # fmt: skip
    for name, value in given.items():
        for part in field_owners()[name]:
            values[part][name] = value
    megatron_aliases.apply(flags, given, values)
    apply_checkpoint_args(values, _explicit(values, defaults, written))
    apply_hf_settings(values, _explicit(values, defaults, written))
    notes += _layers_of_hybrid_pattern(values)
    _require_model_fields(values)
    notes += megatron_aliases.settle(flags, given, values)
    derive_virtual_stages(values)
    _apply_precision(values)
    if environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    return RunConfig(**{part: cls(**values[part]) for part, cls in run_parts().items()})


def _explicit(values: dict, defaults: dict, written: set) -> set[tuple[str, str]]:
    """The (part, field) pairs set by the command line, the YAML file, an alias or the
    checkpoint, not only by an argparse_meta default."""
    return written | {(part, name) for part, settings in values.items() for name in settings
                      if (part, name) not in defaults
                      or settings[name] != defaults[part, name]}  # fmt: skip


def _layers_of_hybrid_pattern(values: dict) -> list[str]:
    """A hybrid model's num_layers is its pattern's decoder layers (Megatron-LM's hybrid
    lines give no --num-layers; the multi-token prediction modules' layers after "/" are
    not among them, nor the "|" of its pipeline segments). A num_layers that disagrees
    gives way to the pattern with a note, as in Megatron-LM (which warns): returns it."""
    pattern = values["model"].get("hybrid_layer_pattern")
    if not isinstance(pattern, str):
        return []
    layers, given = len(split_hybrid_pattern(pattern)[0]), values["model"].get("num_layers")
    values["model"]["num_layers"] = layers
    if given is None or given == layers:
        return []
    return [f"hybrid_layer_pattern={pattern!r} is set: num_layers={given} is ignored for the "
            f"pattern's {layers} decoder layers (as in Megatron-LM)"]  # fmt: skip


def _require_model_fields(values: dict) -> None:
    model_cls = run_parts()["model"]
    required = [
        f.name for f in dataclasses.fields(model_cls)
        if f.init and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]  # fmt: skip
    missing = [name for name in required if name not in values["model"]]
    if missing:
        options = " ".join(f"--{name.replace('_', '-')} N" for name in missing)
        raise ValueError(
            f"the model needs {', '.join(missing)}: give {options} (or set them under "
            "language_model: in the --config file, or take them from a checkpoint with "
            "--use-checkpoint-args)"
        )


def _apply_precision(values: dict) -> None:
    """bf16 / fp16 imply the parameters' dtype, unless params_dtype was set (Megatron)."""
    for part, settings in values.items():
        if "params_dtype" in settings or "params_dtype" not in field_types(run_parts()[part]):
            continue
        if settings.get("bf16"):
            settings["params_dtype"] = torch.bfloat16
        elif settings.get("fp16"):
            settings["params_dtype"] = torch.float16


# Model fields that describe how this run trains, not the architecture it loads: with
# --use-checkpoint-args they still come from the command line / YAML.
