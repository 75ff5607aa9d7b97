"""The command line: options from dataclass fields, and the run's parser."""

from __future__ import annotations

import argparse
import enum
import re
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
import torch

from mp_ckpt import Checkpointer
from mp_train.configuration import yaml_config
from mp_train.configuration.arguments import (
    ArgumentGroupFactory,
    build_parser,
    field_docs,
    parse_config,
)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(kw_only=True)
class Sample:
    count: int = 3
    """How many things to count."""

    ratio: float = 0.5
    """A ratio of two things."""

    name: str = "x"
    """The name of the thing."""

    enabled: bool = True
    """Whether the thing is on."""

    limit: int | None = None
    """An optional limit."""

    old_style_limit: Optional[int] = None  # noqa: UP045
    """The same, spelled with typing.Optional."""

    sizes: list[int] = field(default_factory=lambda: [1, 2])
    """Sizes, one per stage."""

    color: Color = Color.RED
    """A color, by name or value."""

    mode: Literal["fast", "slow"] = "fast"
    """How fast to go."""

    dtype: torch.dtype = torch.float32
    """The parameters' dtype."""

    needed: int
    """A field without a default."""


def _percent(text: str) -> float:
    return float(text.rstrip("%")) / 100


@dataclass(kw_only=True)
class WithMeta:
    width: int = field(default=8, metadata={"argparse_meta": {"names": ["-w", "--breadth"]}})
    """Width of the thing."""

    scale: float = field(default=1.0, metadata={"argparse_meta": {"type": _percent}})
    """Scale, as a percentage."""

    triple: list[int] | None = field(default=None, metadata={"argparse_meta": {"nargs": 3}})
    """Exactly three numbers."""

    seed: int = field(default=1, metadata={"argparse_meta": {"default": 42}})
    """A seed whose command-line default differs."""

    level: str = field(default="low", metadata={"argparse_meta": {"choices": ["low", "high"]}})
    """One of two levels."""

    note: str = field(default="", metadata={"argparse_meta": {"help": "Help from the meta."}})
    """Help from the docstring."""


def _parser(cls, **kwargs) -> tuple[argparse.ArgumentParser, ArgumentGroupFactory]:
    parser = argparse.ArgumentParser(prog="test", allow_abbrev=False)
    factory = ArgumentGroupFactory(cls, **kwargs)
    factory.build_group(parser, "sample")
    return parser, factory


def _help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())


# --- ArgumentGroupFactory ------------------------------------------------------------------


def test_every_type_maps_to_an_option():
    parser, factory = _parser(Sample)
    args = parser.parse_args([
        "--count", "7", "--ratio", "0.25", "--name", "y", "--no-enabled", "--limit", "5",
        "--old-style-limit", "6", "--sizes", "4", "5", "6", "--color", "green", "--mode", "slow",
        "--dtype", "bf16", "--needed", "1",
    ])  # fmt: skip
    values = factory.values(args)
    assert values == {
        "count": 7, "ratio": 0.25, "name": "y", "enabled": False, "limit": 5,
        "old_style_limit": 6, "sizes": [4, 5, 6], "color": Color.GREEN, "mode": "slow",
        "dtype": torch.bfloat16, "needed": 1,
    }  # fmt: skip
    assert Sample(**values).color is Color.GREEN


def test_bool_flags_both_ways():
    parser, _ = _parser(Sample)
    assert parser.parse_args(["--enabled"]).enabled is True
    assert parser.parse_args(["--no-enabled"]).enabled is False


@pytest.mark.parametrize(
    ("word", "dtype"),
    [("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
     ("bfloat16", torch.bfloat16), ("fp16", torch.float16), ("torch.float16", torch.float16)],
)  # fmt: skip
def test_dtype_words(word, dtype):
    parser, _ = _parser(Sample)
    assert parser.parse_args(["--dtype", word]).dtype == dtype


def test_enum_by_name_or_value():
    parser, _ = _parser(Sample)
    assert parser.parse_args(["--color", "GREEN"]).color is Color.GREEN
    assert parser.parse_args(["--color", "red"]).color is Color.RED


def test_optional_accepts_none():
    parser, _ = _parser(Sample)
    assert parser.parse_args(["--limit", "none"]).limit is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--mode", "medium"], "'medium' is not one of fast, slow"),
     (["--count", "many"], "'many' is not an integer"),
     (["--dtype", "int8"], "is not a dtype"),
     (["--color", "blue"], "is not one of RED, GREEN")],
)  # fmt: skip
def test_bad_values_exit_naming_the_option(argv, message, capsys):
    parser, _ = _parser(Sample)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert argv[0] in err and message in err


def test_choices_in_the_metavar():
    parser, _ = _parser(Sample)
    text = _help(parser)
    assert "--mode {fast,slow}" in text
    assert "--dtype {fp32,bf16,fp16}" in text
    assert "--color {RED,GREEN}" in text


def test_help_from_docstrings_with_defaults():
    parser, _ = _parser(Sample)
    text = _help(parser)
    assert "How many things to count. (default: 3)" in text
    assert "Sizes, one per stage. (default: 1 2)" in text
    assert "The parameters' dtype. (default: fp32)" in text
    assert "A field without a default. (required)" in text
    assert field_docs(Sample)["color"] == "A color, by name or value."


def test_help_of_the_run_parser_comes_from_the_config_dataclasses():
    text = _help(build_parser())
    assert "Query heads per layer. (required)" in text
    assert "Ranks that split each layer's weights (TP). (default: 1)" in text
    assert "Samples per micro-batch on one data-parallel rank." in text


def test_only_given_options_are_in_the_namespace():
    parser, factory = _parser(Sample)
    assert vars(parser.parse_args([])) == {}
    assert vars(parser.parse_args(["--count", "3"])) == {"count": 3}
    assert factory.values(parser.parse_args(["--enabled"])) == {"enabled": True}


def test_exclude_and_name_map():
    parser, _ = _parser(Sample, exclude=["ratio"], name_map={"count": "tally"})
    assert parser.parse_args(["--tally", "9"]).count == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["--ratio", "0.1"])
    with pytest.raises(ValueError, match="no field"):
        ArgumentGroupFactory(Sample, exclude=["nope"])


# --- argparse_meta overrides ------------------------------------------------------------


def test_meta_names_add_option_strings():
    parser, _ = _parser(WithMeta)
    assert parser.parse_args(["-w", "3"]).width == 3
    assert parser.parse_args(["--breadth", "4"]).width == 4
    assert parser.parse_args(["--width", "5"]).width == 5


def test_meta_type():
    parser, _ = _parser(WithMeta)
    assert parser.parse_args(["--scale", "50%"]).scale == 0.5


def test_meta_nargs():
    parser, _ = _parser(WithMeta)
    assert parser.parse_args(["--triple", "1", "2", "3"]).triple == [1, 2, 3]
    with pytest.raises(SystemExit):
        parser.parse_args(["--triple", "1", "2"])


def test_meta_default_lies_under_the_given_options():
    parser, factory = _parser(WithMeta)
    assert factory.values(parser.parse_args([])) == {"seed": 42}
    assert factory.values(parser.parse_args(["--seed", "7"])) == {"seed": 7}
    assert "(default: 42)" in _help(parser)


def test_meta_choices():
    parser, _ = _parser(WithMeta)
    assert parser.parse_args(["--level", "high"]).level == "high"
    with pytest.raises(SystemExit):
        parser.parse_args(["--level", "medium"])


def test_meta_help():
    parser, _ = _parser(WithMeta)
    text = _help(parser)
    assert "Help from the meta." in text
    assert "Help from the docstring." not in text


# --- the run's parser ---------------------------------------------------------------------


def test_parse_config_minimal():
    config = parse_config([*MODEL, "--train-iters", "10", "--data-path", "a", "b"])
    assert (config.model.num_layers, config.model.hidden_size) == (4, 64)
    assert config.training.train_iters == 10
    assert config.data.data_path == ["a", "b"]
    assert config.model.params_dtype == torch.float32


def test_shared_names_set_every_part():
    config = parse_config([*MODEL, "--bf16"])
    assert config.model.bf16 and config.optimizer.bf16
    assert config.model.params_dtype == config.optimizer.params_dtype == torch.bfloat16
    config = parse_config([*MODEL, "--fp16"])
    assert config.model.params_dtype == config.optimizer.params_dtype == torch.float16
    config = parse_config([*MODEL, "--bf16", "--params-dtype", "fp32"])
    assert config.model.params_dtype == config.optimizer.params_dtype == torch.float32
    assert "Sets model.bf16 and optimizer.bf16." in _help(build_parser())


def test_an_unexpected_shared_name_is_refused(monkeypatch):
    @dataclass(kw_only=True)
    class Other:
        count: int = 1

    monkeypatch.setattr(yaml_config, "run_parts", lambda: {"a": Sample, "b": Other})
    yaml_config.field_owners.cache_clear()
    try:
        with pytest.raises(ValueError, match="'count' is defined in several parts"):
            yaml_config.field_owners()
    finally:
        monkeypatch.undo()
        yaml_config.field_owners.cache_clear()


@pytest.mark.parametrize(
    ("flags", "part", "name", "value"),
    [(["--swiglu"], "model", "activation", "swiglu"),
     (["--squared-relu"], "model", "activation", "squared_relu"),
     (["--use-rotary-position-embeddings"], "model", "position_embedding_type", "rope"),
     (["--disable-bias-linear"], "model", "add_bias_linear", False),
     (["--untie-embeddings-and-output-weights"], "model",
      "untie_embeddings_and_output_weights", True),
     (["--recompute-activations"], "model", "recompute_granularity", "selective"),
     (["--group-query-attention"], "model", "num_query_groups", 1),
     (["--group-query-attention", "--num-query-groups", "2"], "model", "num_query_groups", 2),
     (["--normalization", "RMSNorm"], "model", "normalization", "RMSNorm"),
     (["--transformer-impl", "local"], "gpt", "transformer_impl", "local"),
     (["--lr-decay-style", "cosine"], "optimizer", "lr_decay_style", "cosine")],
)  # fmt: skip
def test_megatron_flags(flags, part, name, value):
    config = parse_config([*MODEL, *flags])
    assert getattr(getattr(config, part), name) == value


def test_layers_per_virtual_stage():
    argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--pipeline-model-parallel-size", "2"]  # fmt: skip
    config = parse_config([*argv, "--num-layers-per-virtual-pipeline-stage", "2"])
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="num_layers_per_virtual_pipeline_stage=3"):
        parse_config([*argv, "--num-layers-per-virtual-pipeline-stage", "3"])


def test_virtual_stages_as_megatron_derives_them():
    """Megatron-LM's arithmetic: the embedding and the loss count as layers where they are
    accounted for in the split, and one virtual stage per rank is none."""
    argv = ["--hidden-size", "64", "--num-attention-heads", "4",
            "--pipeline-model-parallel-size", "2"]  # fmt: skip

    def vpp(*flags: str) -> int | None:
        return parse_config([*argv, *flags]).parallel.virtual_pipeline_model_parallel_size

    # (2 layers + embedding + loss) / 2 stages / 1 layer: 2 virtual stages, not 1.
    assert vpp("--num-layers", "2", "--num-layers-per-virtual-pipeline-stage", "1",
               "--account-for-embedding-in-pipeline-split",
               "--account-for-loss-in-pipeline-split") == 2  # fmt: skip
    assert vpp("--num-layers", "7", "--num-layers-per-virtual-pipeline-stage", "2",
               "--account-for-embedding-in-pipeline-split") == 2  # fmt: skip
    assert vpp("--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "4") is None
    assert vpp("--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "1") is None
    assert vpp("--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2") == 2


@pytest.mark.parametrize(
    "flags, said",
    [(["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank",
       "2"], "got --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-"),
     (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-layout",
       "Et|tt|tt|tt|tL"], "got --num-virtual-stages-per-pipeline-rank and --pipeline-model-"),
     (["--num-layers-per-virtual-pipeline-stage", "2", "--decoder-first-pipeline-num-layers",
       "2"], "uneven pipeline split takes its virtual stages from --num-virtual-stages-per-"),
     (["--hybrid-layer-pattern", "M*M*M*M*", "--num-layers-per-virtual-pipeline-stage", "1"],
      "--num-layers-per-virtual-pipeline-stage with --hybrid-layer-pattern: a hybrid model's"),
     (["--hybrid-override-pattern", "M*M*M*M*", "--num-virtual-stages-per-pipeline-rank", "2"],
      "--num-virtual-stages-per-pipeline-rank with --hybrid-layer-pattern")],
)  # fmt: skip
def test_virtual_stages_given_twice_or_beside_a_pattern_are_refused(flags, said):
    """Megatron-LM's refusals: one way at most of giving the virtual stages, and a hybrid
    model's come from its pattern's '|' segments. Before, the per-stage count silently won
    over --num-virtual-stages-per-pipeline-rank."""
    argv = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--pipeline-model-parallel-size", "2", "--mamba-num-heads", "8",
            "--mamba-head-dim", "8"]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(said)):
        parse_config([*argv, *flags])


def test_an_alias_contradicting_its_field_is_refused():
    with pytest.raises(ValueError, match="--swiglu sets activation='swiglu'"):
        parse_config([*MODEL, "--swiglu", "--activation", "gelu"])


def test_missing_model_fields_are_named():
    with pytest.raises(ValueError, match="num_layers, num_attention_heads") as caught:
        parse_config(["--hidden-size", "64"])
    assert "--num-layers N --num-attention-heads N" in str(caught.value)


def test_a_part_validation_error_propagates():
    with pytest.raises(ValueError, match="num_attention_heads=5 does not divide hidden_size=64"):
        parse_config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "5"])
    with pytest.raises(ValueError, match=r"min_lr=0.2 must be <= lr=0.1"):
        parse_config([*MODEL, "--lr", "0.1", "--min-lr", "0.2"])
    with pytest.raises(ValueError, match="save_interval=0"):
        parse_config([*MODEL, "--save-interval", "0"])


def test_a_bad_option_value_exits(capsys):
    with pytest.raises(SystemExit):
        parse_config([*MODEL, "--transformer-impl", "fast"])
    assert "--transformer-impl" in capsys.readouterr().err


# --- --use-checkpoint-args --------------------------------------------------------------


def _save_checkpoint(root, argv, common_extra=None) -> None:
    saved = parse_config(argv)
    common = {"iteration": 5, "config": saved.as_dict(), **(common_extra or {})}
    Checkpointer(root).save(5, {}, common=common)


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path):
    _save_checkpoint(tmp_path, [
        "--num-layers", "6", "--hidden-size", "96", "--num-attention-heads", "6",
        "--swiglu", "--use-rotary-position-embeddings", "--seq-length", "256",
        "--hidden-dropout", "0.2", "--micro-batch-size", "8",
    ])  # fmt: skip
    config = parse_config([
        "--load", str(tmp_path), "--use-checkpoint-args", "--num-layers", "2",
        "--hidden-dropout", "0.0", "--micro-batch-size", "2", "--bf16",
    ])  # fmt: skip
    model = config.model
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (6, 96, 6)
    assert (model.activation, model.position_embedding_type) == ("swiglu", "rope")
    assert config.gpt.seq_length == 256
    # How this run trains stays its own.
    assert model.hidden_dropout == 0.0
    assert config.training.micro_batch_size == 2
    assert model.bf16 and model.params_dtype == torch.bfloat16


def test_use_checkpoint_args_takes_the_tokenizer_and_on_request_the_layout(tmp_path):
    _save_checkpoint(tmp_path, [
        *MODEL, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/tok",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "1",
    ])  # fmt: skip
    resume = ["--load", str(tmp_path), "--use-checkpoint-args"]
    config = parse_config(resume)
    assert (config.data.tokenizer_type, config.data.tokenizer_model) == (
        "HuggingFaceTokenizer", "/tok")  # fmt: skip
    assert config.parallel.tensor_model_parallel_size == 1  # the run's own layout
    for off in ("--no-use-tokenizer-model-from-checkpoint-args",
                "--disable-use-tokenizer-model-from-checkpoint-args"):  # fmt: skip
        assert parse_config([*resume, off]).data.tokenizer_model is None
    # A tokenizer given otherwise is refused, not overridden as Megatron-LM does.
    with pytest.raises(ValueError, match=r"tokenizer_model='/other' differs from the "
                       r"checkpoint's '/tok' .* drop tokenizer_model, or set "
                       r"use_tokenizer_model_from_checkpoint_args=False"):  # fmt: skip
        parse_config([*resume, "--tokenizer-model", "/other"])
    assert parse_config([*resume, "--tokenizer-model", "/tok"]).data.tokenizer_model == "/tok"
    layout = parse_config([*resume, "--use-mp-args-from-checkpoint-args"]).parallel
    assert (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size) == (2, 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 differs from the "
                                         "checkpoint's 2"):  # fmt: skip
        parse_config([*resume, "--use-mp-args-from-checkpoint-args",
                      "--tensor-model-parallel-size", "4"])  # fmt: skip
    with pytest.raises(
        ValueError,
        match="use_mp_args_from_checkpoint_args=True reads the "
        "checkpoint's settings: it needs use_checkpoint_args",
    ):
        parse_config([*MODEL, "--use-mp-args-from-checkpoint-args"])


def test_use_checkpoint_args_takes_an_imported_checkpoints_model_settings(tmp_path):
    settings = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 8,
                "num_query_groups": 4, "activation": "swiglu", "normalization": "RMSNorm",
                "position_embedding_type": "rope", "rotary_base": 500000,
                "use_rope_scaling": True, "rope_scaling_factor": 32.0,
                "hidden_dropout": 0.3, "vocab_size": 96,
                "max_position_embeddings": 128}  # fmt: skip
    Checkpointer(tmp_path).save(0, {}, common={"iteration": 0, "model_config": settings})
    config = parse_config(["--load", str(tmp_path), "--use-checkpoint-args",
                           "--micro-batch-size", "1", "--seq-length", "64"])  # fmt: skip
    model = config.model
    assert (model.num_layers, model.num_query_groups, model.rotary_base) == (3, 4, 500000)
    assert model.use_rope_scaling and model.rope_scaling_factor == 32.0
    assert model.hidden_dropout != 0.3  # how this run trains stays its own
    assert (config.gpt.max_position_embeddings, config.gpt.seq_length) == (128, 64)
    with pytest.raises(ValueError, match=r"records no parallel sizes \(an imported checkpoint"):
        parse_config(["--load", str(tmp_path), "--use-checkpoint-args",
                      "--use-mp-args-from-checkpoint-args"])  # fmt: skip


def test_use_checkpoint_args_needs_a_saved_config(tmp_path):
    Checkpointer(tmp_path).save(1, {}, common={"iteration": 1})
    with pytest.raises(ValueError, match="holds no run config"):
        parse_config(["--load", str(tmp_path), "--use-checkpoint-args", *MODEL])


def test_use_checkpoint_args_without_a_checkpoint(tmp_path):
    argv = ["--load", str(tmp_path), "--use-checkpoint-args", *MODEL]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parse_config(argv).model.num_layers == 4
    assert any("no checkpoint under" in str(w.message) for w in caught)
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        parse_config([*argv, "--exit-on-missing-checkpoint"])
    with pytest.raises(ValueError, match="needs load"):
        parse_config(["--use-checkpoint-args", *MODEL])


def test_a_window_parses_as_megatron_writes_it():
    """tuple[int, int] from one word "127,0"; int | list[int] from "2" or a pattern."""
    config = parse_config([*MODEL, "--window-size", "127,0", "--window-attn-skip-freq", "2",
                           "--softmax-type", "learnable"])  # fmt: skip
    assert config.model.window_size == (127, 0)
    assert config.model.window_attn_skip_freq == 2
    assert config.model.softmax_type == "learnable"
    config = parse_config([*MODEL, "--window-size", "(3, 0)", "--window-attn-skip-freq",
                           "[1,0]*2"])  # fmt: skip
    assert config.model.window_attn_skip_freq == [1, 0, 1, 0]
    config = parse_config([*MODEL, "--window-size", "3,0", "--window-attn-skip-freq", "1,1,0,1"])
    assert config.model.window_attn_skip_freq == [1, 1, 0, 1]
    help_text = build_parser().format_help()
    assert "--window-size N,N" in help_text and "--window-attn-skip-freq N|LIST" in help_text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window-size", "127"], r"'127' is not 2 values"),
        (["--window-size", "a,0"], r"'a' is not an integer"),
        (["--window-attn-skip-freq", "[1,x]"], r"a Python list expression of integer lists"),
    ],
)
def test_a_bad_window_exits_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config([*MODEL, *argv])
    assert re.search(message, capsys.readouterr().err)


def test_yarn_options_take_megatrons_names():
    config = parse_config([*MODEL, "--position-embedding-type", "yarn", "--rotary-scaling-factor",
                           "32", "--yarn-original-max-position-embeddings", "4096", "--mscale",
                           "1.0", "--no-yarn-correction-range-round-to-int"])  # fmt: skip
    model = config.model
    assert (model.position_embedding_type, model.yarn_rotary_scaling_factor) == ("yarn", 32.0)
    assert model.yarn_correction_range_round_to_int is False
