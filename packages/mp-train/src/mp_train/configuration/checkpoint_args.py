"""--use-checkpoint-args (Megatron-LM's): the settings a run takes from the checkpoint it
loads, read from its common.pt before the run's config is built. The model's
architecture always; the tokenizer (--use-tokenizer-model-from-checkpoint-args, on by
default) and the parallel sizes (--use-mp-args-from-checkpoint-args) as Megatron takes
them, except that a value the run was given otherwise is refused rather than
overridden."""

from __future__ import annotations

import warnings

import torch

from mp_ckpt import CheckpointReader, is_hf_directory
from mp_train.configuration.yaml_config import field_types, run_parts

__all__ = ["apply_checkpoint_args"]


_RUN_MODEL_FIELDS = frozenset({
    "bf16", "fp16", "params_dtype", "hidden_dropout", "attention_dropout", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers",
})  # fmt: skip


def _saved_run_config(common: object) -> dict | None:
    """The saved run config ({"model": ..., "gpt": ...}) of a checkpoint's common.pt. One
    without a run config but with model settings under Megatron's names (`mp-ckpt
    import-hf` writes them) gives those and its max_position_embeddings."""
    if not isinstance(common, dict):
        return None
    saved = common.get("config")
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        return saved
    settings = common.get("model_config")
    if not isinstance(settings, dict):
        return None
    gpt = {"max_position_embeddings": settings["max_position_embeddings"]}
    return {"model": settings, "gpt": gpt if "max_position_embeddings" in settings else {}}


def apply_checkpoint_args(values: dict, explicit: set[tuple[str, str]]) -> None:
    """--use-checkpoint-args: the model's architecture, seq_length and
    max_position_embeddings from the config saved in the checkpoint's common.pt; with
    use_tokenizer_model_from_checkpoint_args (the default) its tokenizer type and model,
    with use_mp_args_from_checkpoint_args its parallel sizes (Megatron's rules). Those two
    override what the run was given, which must then agree with the checkpoint
    (`explicit`: the (part, field) pairs the run set)."""
    settings = values["checkpoint"]
    if not settings.get("use_checkpoint_args"):
        if settings.get("use_mp_args_from_checkpoint_args"):
            raise ValueError("use_mp_args_from_checkpoint_args=True reads the checkpoint's "
                             "settings: it needs use_checkpoint_args")  # fmt: skip
        return
    load = settings.get("load")
    if load is None:
        raise ValueError("use_checkpoint_args=True needs load (the checkpoint to read)")
    if is_hf_directory(load):
        return  # its config.json gives the settings (apply_hf_settings)
    try:
        reader = CheckpointReader(load, iteration=settings.get("ckpt_step"))
    except FileNotFoundError as error:
        if settings.get("exit_on_missing_checkpoint"):
            raise FileNotFoundError(
                f"use_checkpoint_args=True: no checkpoint under load={load}: {error}"
            ) from error
        warnings.warn(
            f"use_checkpoint_args=True but no checkpoint under load={load} ({error}); "
            "using the given model settings", stacklevel=3,
        )  # fmt: skip
        return
    path = reader.directory / "common.pt"
    common = torch.load(path, weights_only=False)
    saved = _saved_run_config(common)
    if saved is None:
        raise ValueError(
            f"{path} holds no run config (common['config']['model']) nor model settings "
            "(common['model_config']): the checkpoint cannot provide the model's settings; "
            "drop use_checkpoint_args"
        )
    taken = [("model", n) for n in saved["model"] if n not in _RUN_MODEL_FIELDS]
    taken += [("gpt", n) for n in ("seq_length", "max_position_embeddings")
              if n in saved.get("gpt", {})]  # fmt: skip
    for part, name in taken:
        kind = field_types(run_parts()[part]).get(name)
        if kind is None:  # a field this version does not have
            continue
        value = saved[part][name]
        try:
            values[part][name] = kind.convert(value)
        except ValueError as error:
            raise ValueError(f"{path}: config {part}.{name}={value!r}: {error}") from None
    if settings.get("use_tokenizer_model_from_checkpoint_args", True):
        _take_forced(values, explicit, saved, path, "data", _TOKENIZER_ARGS,
                     "use_tokenizer_model_from_checkpoint_args")  # fmt: skip
    if settings.get("use_mp_args_from_checkpoint_args"):
        if not isinstance(saved.get("parallel"), dict):
            raise ValueError(
                f"use_mp_args_from_checkpoint_args=True: {path} records no parallel sizes (an "
                "imported checkpoint): give them instead"
            )
        _take_forced(values, explicit, saved, path, "parallel", _PARALLEL_ARGS,
                     "use_mp_args_from_checkpoint_args")  # fmt: skip


_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model")
"""What use_tokenizer_model_from_checkpoint_args takes (Megatron's)."""

_PARALLEL_ARGS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
)  # fmt: skip
"""What use_mp_args_from_checkpoint_args takes (Megatron's)."""


def _take_forced(values: dict, explicit: set, saved: dict, path, part: str, names, switch: str):
    """The checkpoint's `names` of `part` over the run's; one the run set otherwise is
    refused, naming `switch` (Megatron overrides it silently)."""
    recorded = saved.get(part)
    if not isinstance(recorded, dict):
        return
    for name in names:
        if name not in recorded:
            continue
        value = recorded[name]
        if (part, name) in explicit and values[part].get(name) != value:
            raise ValueError(
                f"{name}={values[part][name]!r} differs from the checkpoint's {value!r} "
                f"({path}); with use_checkpoint_args the checkpoint's is taken ({switch}): "
                f"drop {name}, or set {switch}=False"
            )
        values[part][name] = value
