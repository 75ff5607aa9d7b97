"""Megatron-LM's flags that stand for settings of mp's fields: `--swiglu` for
activation=swiglu, `--group-query-attention`, the deprecated rotary spellings, a
per-virtual-stage layer count, and the rules Megatron's validation applies to
them and to the values it derives (sequence parallelism switched off without tensor
parallelism, the nan check off under fp16's dynamic loss scaling, no optimizer state
loaded when skipping training; one way at most of giving virtual pipeline stages).

`add_to(parser)` adds them to the run's parser; `take(given)` removes them from
the parsed options; `apply(flags, given, values)` sets what they stand for in
`values` (part -> field -> value), before a checkpoint's settings are read;
`settle(flags, given, values)` applies the rules that need the final values and
returns the notes rank 0 prints; `check_virtual_stage_flags(flags, given, values)`, before
megatron_flags.apply, refuses two ways of giving the virtual pipeline stages.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from mp_train.configuration.yaml_config import FieldType, run_parts

__all__ = ["add_to", "apply", "check_virtual_stage_flags", "expand_presets", "settle", "take"]

# flag (dest) -> help
_HELP = {
    "swiglu": "Use the SwiGLU MLP (sets activation=swiglu).",
    "squared_relu": "Use the squared-ReLU MLP (sets activation=squared_relu).",
    "group_query_attention": "Use grouped-query attention with num_query_groups key/value "
    "heads (1 when --num-query-groups is not given, as in Megatron-LM).",
    "use_rotary_position_embeddings": "Rotary position embeddings (sets "
    "position_embedding_type=rope).",
    "disable_bias_linear": "No biases in linear layers (sets add_bias_linear=False).",
    "recompute_activations": "Recompute core attention in backward (sets "
    "recompute_granularity=selective).",
    "use_flash_attn": "Flash attention (sets attention_backend=flash: torch's SDPA, a "
    "flash-attention kernel on CUDA).",
    "torch_fsdp2_no_reshard_after_forward": "Keep each layer's gathered parameters until "
    "its backward under --use-torch-fsdp2 (ZeRO-2; sets "
    "torch_fsdp2_reshard_after_forward=False).",
    "no_position_embedding": "Megatron-LM's deprecated spelling, kept for RoPE models: "
    "accepted when position_embedding_type is rope (it leaves RoPE on, as in Megatron-LM), "
    "refused otherwise (give --position-embedding-type).",
}
# flag (dest) -> (RunConfig part, field, value it sets)
_SETS = {
    "swiglu": ("model", "activation", "swiglu"),
    "squared_relu": ("model", "activation", "squared_relu"),
    "use_rotary_position_embeddings": ("model", "position_embedding_type", "rope"),
    "disable_bias_linear": ("model", "add_bias_linear", False),
    "recompute_activations": ("model", "recompute_granularity", "selective"),
    "use_flash_attn": ("model", "attention_backend", "flash"),
    "torch_fsdp2_no_reshard_after_forward": (
        "optimizer",
        "torch_fsdp2_reshard_after_forward",
        False,
    ),
}
_PER_STAGE = "num_layers_per_virtual_pipeline_stage"
_STAGES_PER_RANK = "num_virtual_stages_per_pipeline_rank"  # megatron_flags.RENAMED
_ACCOUNTED = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")

# Flags that stand for several others, appended after the command line so that they win
# over it, as Megatron-LM sets them over the arguments. --enable-gpt-oss is ModelOpt's
# switch (megatron/post_training/model_builder.py): gpt-oss's YaRN rotary settings.
PRESETS: dict[str, tuple[str, list[str]]] = {
    "enable_gpt_oss": (
        "gpt-oss's YaRN rotary embeddings",
        ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "32",
         "--yarn-original-max-position-embeddings", "131072", "--yarn-beta-fast", "32",
         "--yarn-beta-slow", "1", "--mscale", "1.0", "--mscale-all-dim", "0.0",
         "--no-yarn-correction-range-round-to-int"],
    ),
}  # fmt: skip


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_to(parser: argparse.ArgumentParser) -> None:
    """Adds the alias flags (and the presets) to the run's parser, in one group."""
    group = parser.add_argument_group("Megatron-LM aliases")
    for dest, help_text in _HELP.items():
        group.add_argument(_option(dest), action="store_true", default=argparse.SUPPRESS,
                           help=help_text)  # fmt: skip
    group.add_argument(
        _option(_PER_STAGE), dest=_PER_STAGE, type=int, metavar="N",
        default=argparse.SUPPRESS,
        help="Layers per virtual pipeline stage (sets virtual_pipeline_model_parallel_size "
        "= num_layers / pipeline_model_parallel_size / N).",
    )  # fmt: skip
    for dest, (what, flags) in PRESETS.items():
        group.add_argument(_option(dest), action="store_true", default=argparse.SUPPRESS,
                           help=f"{what}: stands for {' '.join(flags)}.")  # fmt: skip


def expand_presets(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with each preset flag replaced by the flags it stands for, put last; a preset
    whose flags this build lacks raises a ValueError naming them."""
    for dest, (what, flags) in PRESETS.items():
        if _option(dest) not in argv:
            continue
        lacking = _unknown(parser, flags)
        if lacking:
            raise ValueError(
                f"{_option(dest)} stands for {what} ({' '.join(flags)}); this build lacks "
                f"{', '.join(lacking)}"
            )
        argv = [word for word in argv if word != _option(dest)] + flags
    return argv


def _unknown(parser: argparse.ArgumentParser, flags: list[str]) -> list[str]:
    """The flags (or flag values) of `flags` that the parser does not accept."""
    lacking, actions = [], parser._option_string_actions
    for i, word in enumerate(flags):
        if not word.startswith("--"):
            continue
        action = actions.get(word)
        if action is None:
            lacking.append(word)
        elif action.type is not None and i + 1 < len(flags):
            try:
                action.type(flags[i + 1])
            except (argparse.ArgumentTypeError, ValueError):
                lacking.append(f"{word} {flags[i + 1]}")
    return lacking


def take(given: dict[str, Any]) -> dict[str, Any]:
    """Removes the alias flags from the parsed options; returns them."""
    return {name: given.pop(name) for name in [*_HELP, _PER_STAGE] if name in given}


def apply(flags: dict, given: dict, values: dict) -> None:
    """Sets the fields the alias flags stand for (after the options and the YAML file)."""
    # Megatron-LM's TransformerConfig refuses the two MLPs at once.
    if "swiglu" in flags and "squared_relu" in flags:
        raise ValueError("--swiglu and --squared-relu each choose the MLP's activation: "
                         "give one (Megatron-LM refuses both)")  # fmt: skip
    for flag, (part, name, value) in _SETS.items():
        if flag in flags:
            _set_from_flag(flag, part, name, value, given, values)
    # Megatron's --num-query-groups defaults to 1: GQA without a group count is MQA.
    if "group_query_attention" in flags and values["model"].get("num_query_groups") is None:
        values["model"]["num_query_groups"] = 1


def settle(flags: dict, given: dict, values: dict) -> list[str]:
    """The rules that read the final values (after --use-checkpoint-args); returns notes."""
    _apply_layers_per_stage(flags, given, values)
    position = _current(values, "model", "position_embedding_type")
    # Megatron-LM: --no-position-embedding is deprecated and only allowed with RoPE, which
    # it leaves on (arguments.py: "use --position-embedding-type").
    if "no_position_embedding" in flags and position != "rope":
        raise ValueError(
            f"--no-position-embedding with position_embedding_type={position!r}: the flag is "
            "Megatron-LM's deprecated spelling, allowed only with rope (which it keeps); give "
            "--position-embedding-type none (or rope) instead"
        )
    notes = []
    # Megatron-LM reads --num-experts 0 as a dense model, and a negative
    # --moe-expert-capacity-factor as no capacity (no token dropped).
    if values["model"].get("num_moe_experts") == 0:
        values["model"]["num_moe_experts"] = None
    factor = values["model"].get("moe_expert_capacity_factor")
    if factor is not None and factor < 0:
        values["model"]["moe_expert_capacity_factor"] = None
    # Without experts, moe_ffn_hidden_size is refused, unless moe_layer_freq names dense
    # layers: Megatron-LM then takes it for a mixed model's dense layer and drops it.
    freq = _current(values, "model", "moe_layer_freq")
    freq = freq if isinstance(freq, list) else [freq]
    mixed = 0 in freq or (len(freq) == 1 and freq[0] > 1)
    unused = values["model"].get("moe_ffn_hidden_size")
    if values["model"].get("num_moe_experts") is None and unused is not None and mixed:
        values["model"]["moe_ffn_hidden_size"] = None
        notes.append(f"moe_ffn_hidden_size={unused} without num_moe_experts: dropped, the "
                     "layers being dense (as in Megatron-LM)")  # fmt: skip
    # Megatron-LM switches sequence parallelism off without tensor parallelism, to keep the
    # numerics of TP 1.
    tp = _current(values, "parallel", "tensor_model_parallel_size")
    if tp == 1 and _current(values, "model", "sequence_parallel"):
        values["model"]["sequence_parallel"] = False
        notes.append("sequence_parallel=True with tensor_model_parallel_size=1: sequence "
                     "parallelism is off (as in Megatron-LM)")  # fmt: skip
    # Under dynamic loss scaling an inf or nan gradient is the scaler's signal (it skips
    # the step and lowers the scale), not a fault: Megatron-LM stops checking for them.
    fp16 = _current(values, "optimizer", "fp16") and not _current(values, "optimizer", "bf16")
    dynamic = fp16 and _current(values, "optimizer", "loss_scale") is None
    if dynamic and _current(values, "training", "check_for_nan_in_loss_and_grad"):
        values["training"]["check_for_nan_in_loss_and_grad"] = False
        notes.append("fp16 with dynamic loss scaling (no loss_scale): "
                     "check_for_nan_in_loss_and_grad is off, the loss scaler skipping the "
                     "steps whose gradients are not finite (as in Megatron-LM)")  # fmt: skip
    # A run that only evaluates has no use for the optimizer's state.
    if _current(values, "training", "skip_train") and not _current(
            values, "checkpoint", "no_load_optim"):  # fmt: skip
        values["checkpoint"]["no_load_optim"] = True
        notes.append("skip_train: no_load_optim is on, the optimizer's state is not loaded "
                     "(as in Megatron-LM)")  # fmt: skip
    # Upcycling starts a new run from a dense model's weights (Megatron-LM's rule).
    if _current(values, "training", "moe_use_upcycling"):
        for name, what in (("no_load_optim", "optimizer"), ("no_load_rng", "RNG")):
            if not _current(values, "checkpoint", name):
                values["checkpoint"][name] = True
                notes.append(f"moe_use_upcycling: {name} is on, the dense checkpoint's "
                             f"{what} state is not loaded (as in Megatron-LM)")  # fmt: skip
    return notes


def _set_from_flag(flag: str, part: str, name: str, value, given: dict, values: dict) -> None:
    if name in given and given[name] != value:
        raise ValueError(
            f"{_option(flag)} sets {name}={value!r} but {_option(name)} "
            f"gives {FieldType.show(given[name])}"
        )
    values[part][name] = value


def _current(values: dict, part: str, name: str) -> Any:
    """The value a field will have: as set, else the dataclass default."""
    if name in values[part]:
        return values[part][name]
    f = next(f for f in dataclasses.fields(run_parts()[part]) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _apply_layers_per_stage(flags: dict, given: dict, values: dict) -> None:
    """Megatron-LM's --num-layers-per-virtual-pipeline-stage N: the layers of a pipeline
    stage (the embedding and the loss counted as layers with
    --account-for-embedding/loss-in-pipeline-split) / N virtual stages per rank, none when
    that is 1."""
    if _PER_STAGE not in flags:
        return
    per_stage = flags[_PER_STAGE]
    layers = values["model"]["num_layers"]
    parallel = values["parallel"]
    uneven = [_option(name) for name in ("decoder_first_pipeline_num_layers",
                                         "decoder_last_pipeline_num_layers")
              if parallel.get(name) is not None]  # fmt: skip
    if uneven:
        raise ValueError(
            f"{_option(_PER_STAGE)} with {' and '.join(uneven)}: an uneven pipeline split "
            "takes its virtual stages from --num-virtual-stages-per-pipeline-rank (as in "
            "Megatron-LM)"
        )
    counted = layers + sum(bool(parallel.get(name)) for name in _ACCOUNTED)
    pp = _current(values, "parallel", "pipeline_model_parallel_size")
    if per_stage < 1 or counted % pp or (counted // pp) % per_stage:
        extra = f" + {counted - layers} (accounted for)" if counted != layers else ""
        raise ValueError(
            f"{_PER_STAGE}={per_stage} must divide the layers of each pipeline stage: "
            f"num_layers={layers}{extra} / pipeline_model_parallel_size={pp}"
        )
    vpp = counted // pp // per_stage
    _set_from_flag(_PER_STAGE, "parallel", "virtual_pipeline_model_parallel_size",
                   vpp if vpp > 1 else None, given, values)  # fmt: skip


def check_virtual_stage_flags(flags: dict, given: dict, values: dict) -> None:
    """Megatron-LM's rules for its three ways of giving virtual pipeline stages
    (--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,
    --pipeline-model-parallel-layout): one at most, and the first two not with a hybrid
    pattern, whose "|" place the stages. Before megatron_flags.apply takes the second;
    --num-virtual-stages-per-pipeline-rank 1 means none, as in Megatron-LM."""
    named = [_option(_PER_STAGE)] if _PER_STAGE in flags else []
    if given.get(_STAGES_PER_RANK) is not None:
        named.append(_option(_STAGES_PER_RANK))
        if given[_STAGES_PER_RANK] == 1:
            given[_STAGES_PER_RANK] = None
    layout = given.get("pipeline_model_parallel_layout",
                       values["parallel"].get("pipeline_model_parallel_layout"))  # fmt: skip
    if layout is not None:
        named.append("--pipeline-model-parallel-layout")
    if len(named) > 1:
        raise ValueError(
            "no more than one of --num-layers-per-virtual-pipeline-stage, "
            "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout "
            f"may be given (as in Megatron-LM); got {' and '.join(named)}"
        )
    pattern = next((given[name] for name in ("hybrid_layer_pattern", "hybrid_override_pattern")
                    if given.get(name) is not None),
                   values["model"].get("hybrid_layer_pattern"))  # fmt: skip
    if layout is not None:
        return  # derive_virtual_stages refuses the layout beside a pattern
    if named and pattern is not None:
        raise ValueError(
            f"{named[0]} with --hybrid-layer-pattern: a hybrid model's virtual pipeline "
            "stages are the pattern's '|' segments, a multiple of "
            "--pipeline-model-parallel-size (as in Megatron-LM); drop the flag"
        )
