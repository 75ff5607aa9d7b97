"""A Megatron-LM flag mp honours takes Megatron-LM's default when left out, except the
differences docs/migrating-from-megatron.md lists ("Defaults that differ").

The Megatron-LM side is assets/megatron_flag_defaults.json, written from Megatron-LM's own
parser by ci/gen_megatron_flag_defaults.py (the value each flag's destination takes when
left out). Every option string both parsers have is compared where mp's destination is
a field of its run configuration (refused and accepted-without-effect flags have none).
"""

from __future__ import annotations

import enum
import json
import signal
from pathlib import Path

import pytest

from mp_train import build_parser, parse_config
from mp_train.configuration import megatron_flags
from mp_train.configuration.megatron_ignored import IGNORED
from mp_train.configuration.yaml_config import field_owners

MEGATRON = json.loads((Path(__file__).parent / "assets" / "megatron_flag_defaults.json")
                      .read_text())  # fmt: skip

# The command line the comparison parses: these flags are given, not compared.
GIVEN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--train-iters", "10", "--mock-data"]  # fmt: skip

# flag -> (Megatron-LM's default, mp's): docs/migrating-from-megatron.md, "Defaults that
# differ", says why each differs.
DIFFERENT = {
    "--dist-ckpt-strictness": ("assume_ok_unexpected", None),
    "--log-throughput": (False, True),
    "--eval-interval": (None, 1000),
    "--transformer-impl": ("transformer_engine", "local"),
    "--fp8-recipe": ("delayed", "tensorwise"),
    "--distributed-backend": ("nccl", None),
    "--micro-batch-size": (None, 1),
}

# Megatron-LM parses None (or a placeholder) and its argument validation derives the value
# from others; mp derives the same when the configuration is made: the flag -> mp's value
# for GIVEN and what it is derived from.
DERIVED = {
    "--ffn-hidden-size": (256, "4 x hidden_size"),
    "--kv-channels": (16, "hidden_size / num_attention_heads"),
    "--num-query-groups": (4, "num_attention_heads, without --group-query-attention"),
    "--expert-tensor-parallel-size": (1, "tensor_model_parallel_size"),
    "--split": ("969, 30, 1", "Megatron-LM's split when data paths are given"),
    "--dataloader-type": ("single", "single, without --dataloader-type"),
    "--yarn-original-max-position-embeddings": (4096, "YaRN's defaults"),
    "--yarn-beta-fast": (32.0, "YaRN's defaults"),
    "--yarn-beta-slow": (1.0, "YaRN's defaults"),
    "--yarn-correction-range-round-to-int": (True, "YaRN's defaults"),
}

# Megatron-LM's destination says the opposite of mp's field (a negative flag stored into a
# positive name, or the reverse): the flag -> Megatron-LM's destination.
OPPOSITE = {
    "--disable-gloo-process-groups": "use_gloo_process_groups",
    "--no-initialization": "perform_initialization",
}


def _plain(value):
    """mp's value as the JSON file holds Megatron-LM's: an enum as its value, a tuple as a
    list."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def _same(megatron, mine) -> bool:
    if isinstance(megatron, dict):  # an enum member, "<AttnBackend.auto: 5>": by its name
        return megatron["repr"].strip("<>").split(":")[0].split(".")[-1] == str(mine)
    if megatron is None and mine is False:  # a switch left off, unset in Megatron-LM
        return True
    if [megatron] == mine or megatron == [mine]:
        return True  # a one-element list on one side, its value on the other
    if isinstance(megatron, int) and isinstance(mine, str) and mine.startswith("SIG"):
        return signal.Signals[mine] == megatron  # a signal by number, mp's by name
    return megatron == mine


def compared() -> dict[str, tuple]:
    """Each flag both parsers have whose mp destination is a field: flag -> (Megatron-LM's
    default, mp's). Two flags of one destination on both sides count once."""
    config = parse_config(GIVEN, environ={"RANK": "1"})
    owners, flags, seen = field_owners(), MEGATRON["flags"], set()
    out = {}
    for action in build_parser()._actions:
        dest = action.dest
        if dest in megatron_flags.REFUSED or dest in IGNORED:
            continue
        if dest in megatron_flags.RENAMED:
            part, field, _ = megatron_flags.RENAMED[dest]
        elif dest in owners:
            part, field = next(iter(owners[dest])), dest
        else:
            continue
        for name in action.option_strings:
            if name not in flags or name in GIVEN or (flags[name]["dest"], field) in seen:
                continue
            seen.add((flags[name]["dest"], field))
            mine = _plain(getattr(getattr(config, part), field))
            if name in OPPOSITE:
                assert flags[name]["dest"] == OPPOSITE[name], name
                mine = not mine
            out[name] = (flags[name]["default"], mine)
    return out


def test_mp_takes_megatrons_defaults_except_the_listed_ones():
    both = compared()
    assert len(both) > 300, "fewer flags compared than the two parsers share"
    unlisted = {name: values for name, values in both.items()
                if name not in DIFFERENT and name not in DERIVED
                and not _same(*values)}  # fmt: skip
    assert unlisted == {}, "defaults that differ from Megatron-LM's and are not listed"


def test_the_listed_differences_hold_and_the_docs_name_them():
    both = compared()
    docs = (Path(__file__).parents[3] / "docs" / "migrating-from-megatron.md").read_text()
    table = docs.split("### Defaults that differ", 1)[1].split("\n### ", 1)[0]
    for name, (megatron, mine) in DIFFERENT.items():
        assert both[name] == (megatron, mine), name
        assert f"`{name}`" in table, name
    for name, (mine, _) in DERIVED.items():
        assert both[name][1] == mine, name


@pytest.mark.parametrize("flag", sorted(OPPOSITE))
def test_opposite_destinations_mean_the_same(flag):
    """Left out, Megatron-LM's --disable-gloo-process-groups keeps the gloo groups
    (use_gloo_process_groups True), as mp's disable_gloo_process_groups False does;
    likewise --no-initialization."""
    megatron, mine = compared()[flag]
    assert megatron is True and mine is True
