"""Megatron-LM flags that have no field of their own in mp: accepted without effect,
accepted as another name of one of ours, or refused with the reason.

A launch line pasted from Megatron-LM carries flags that pick CUDA fusions or
implementations mp does not have or need (mp runs one implementation, whose
numerics each flag's note states), older spellings of flags mp has, and a few
features mp does not implement. Each is listed here once; `add_to(parser)` adds
them to the run's parser (with their notes as help, so `--help` shows them) and
`apply(given, values)` takes them out of the parsed options, setting what they
stand for or raising a ValueError that names the flag and what to do instead.
docs/migrating-from-megatron.md holds the same table for readers. The flags accepted
without effect are megatron_ignored.py's table.
"""

from __future__ import annotations

import argparse
from typing import Any

from mp_train.configuration import megatron_cuda_graphs, megatron_spec
from mp_train.configuration.megatron_ignored import IGNORED

__all__ = ["IGNORED", "REFUSED", "RENAMED", "add_to", "apply", "refuse"]

_FP8_DELAYED = (
    "a knob of delayed FP8 scaling (Transformer Engine's); mp's FP8 (torchao) scales each "
    "tensor from its current amax: drop it"
)

# flag (dest) -> why mp refuses it and what to do instead
REFUSED: dict[str, tuple[bool, str]] = {
    "fp8_margin": (True, _FP8_DELAYED),
    "fp8_amax_history_len": (True, _FP8_DELAYED),
    "fp8_amax_compute_algo": (True, _FP8_DELAYED),
    "fp8_param_gather": (
        False,
        "FP8 parameters and their all-gather need Transformer "
        "Engine: mp keeps parameters in their dtype under --fp8-format",
    ),
    "fp8_dot_product_attention": (
        False,
        "FP8 attention needs Transformer Engine: mp's attention stays in bf16 under --fp8-format",
    ),
    "fp8_multi_head_attention": (
        False,
        "FP8 attention needs Transformer Engine: mp's attention stays in bf16 under --fp8-format",
    ),
    "moe_flex_dispatcher_backend": (
        True,
        "picks the flex dispatcher's kernels (DeepEP, HybridEP), which mp does not have: "
        "drop it and use --moe-token-dispatcher-type alltoall, which moves the same tokens",
    ),
    # Megatron-LM's own refusals of its deprecated flags.
    "batch_size": (True, "no longer valid in Megatron-LM either: use --micro-batch-size"),
    "warmup": (
        True,
        "Megatron-LM's old warm-up flag, no longer valid there either: use "
        "--lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction",
    ),
    "model_parallel_size": (
        True,
        "no longer valid in Megatron-LM either: use --tensor-model-parallel-size",
    ),
    "checkpoint_activations": (
        False,
        "no longer valid in Megatron-LM either: use --recompute-activations, or "
        "--recompute-granularity and --recompute-method",
    ),
}

# flag (dest) -> (RunConfig part, field, type): another name (or an older spelling) of a field
RENAMED: dict[str, tuple[str, str, Any]] = {
    "norm_epsilon": ("model", "layernorm_epsilon", float),
    "hybrid_override_pattern": ("model", "hybrid_layer_pattern", str),
    "ddp_bucket_size": ("optimizer", "bucket_size", int),
    "ddp_num_buckets": ("optimizer", "num_buckets", int),
    "num_virtual_stages_per_pipeline_rank": (
        "parallel",
        "virtual_pipeline_model_parallel_size",
        int,
    ),
    "persistent_save_interval": ("checkpoint", "save_interval", int),
}
# Other names of switches mp has: Megatron's spellings with an underscore inside the flag
# name, and ModelOpt's export names of Llama 4's features (megatron/post_training/
# arguments.py; its model builder sets the core fields from them).
_SPELLINGS = {
    "override-opt_param-scheduler": "override_opt_param_scheduler",
    "use-checkpoint-opt_param-scheduler": "use_checkpoint_opt_param_scheduler",
    "export-qk-l2-norm": "qk_l2_norm",
    "export-moe-apply-probs-on-input": "moe_apply_probs_on_input",
    "ddp-average-in-collective": "average_in_collective",
}
# Megatron's negative spellings of switches mp has (store_false into the field)
_NEGATIONS = {
    "muon-no-split-qkv": "muon_split_qkv",
    "disable-manual-gc-eval": "manual_gc_eval",
    "no-barrier-with-level-1-timing": "barrier_with_L1_time",
    "disable-log-loss-scale-to-tensorboard": "log_loss_scale_to_tensorboard",
    "disable-fp8-wgrad": "fp8_wgrad",
    "disable-use-tokenizer-model-from-checkpoint-args": "use_tokenizer_model_from_checkpoint_args",
    "disable-pad-vocab-size": "pad_vocab_size",
}
# ModelOpt's --export-model-type: GPTModel, or a Mamba-hybrid model (HybridModel, MambaModel),
# which --hybrid-layer-pattern describes.
_MODEL_TYPE = "export_model_type"
_MODEL_TYPES = ("GPTModel", "HybridModel", "MambaModel")
# The checkpoint format flags: mp writes and reads torch_dist-style checkpoints only (under
# FSDP too, where Megatron-LM names its format fsdp_dtensor).
_FORMATS = ("ckpt_format", "dist_ckpt_format")
# Megatron-LM's older form of a hybrid model's multi-token prediction layers, one module's
# pattern repeated --mtp-num-layers times after the decoder's (the unified pattern's "/").
_MTP_PATTERN = "mtp_hybrid_override_pattern"
_FORMAT_CHOICES = ("torch_dist", "torch", "torch_dcp", "zarr", "fsdp_dtensor")
# Megatron-LM's other spelling of --apply-wd-to-qk-layernorm (its one choice)
_WD_COND = "no_weight_decay_cond_type"
# Megatron-LM's other rank order: tp-cp-ep-pp-dp instead of its default tp-cp-ep-dp-pp
_TP_PP_DP = "use_tp_pp_dp_mapping"
# Megatron-FSDP's gradient dtypes (its --megatron-fsdp-main-grads-dtype and
# --megatron-fsdp-grad-comm-dtype): mp's FSDP accumulates and reduces in one dtype.
_FSDP_GRADS = ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")
# and its main parameters' dtype: mp's FSDP steps fp32 main parameters
_FSDP_PARAMS = "megatron_fsdp_main_params_dtype"
# and what it shards across distributed-optimizer instances (the outer level of its hybrid
# sharding): mp's shards nothing there
_FSDP_OUTER = "outer_dp_sharding_strategy"


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_to(parser: argparse.ArgumentParser) -> None:
    """Adds the flags above to the run's parser, each in a group saying what it does."""
    ignored = parser.add_argument_group(
        "Megatron-LM flags accepted without effect", "Each selects something mp does not have "
        "or need; its help says why the run is the same without it.")  # fmt: skip
    for dest, (valued, why) in IGNORED.items():
        _add(ignored, dest, valued, f"No effect: {why}.")
    megatron_spec.add_to(ignored)
    megatron_cuda_graphs.add_to(ignored)
    refused = parser.add_argument_group("Megatron-LM flags refused", "Given, the run stops "
                                        "with the reason.")  # fmt: skip
    for dest, (valued, why) in REFUSED.items():
        _add(refused, dest, valued, f"Refused: {why}.")
    renamed = parser.add_argument_group("Megatron-LM names of mp's fields")
    for dest, (_, field, kind) in RENAMED.items():
        renamed.add_argument(_option(dest), dest=dest, type=kind, default=argparse.SUPPRESS,
                             metavar="X", help=f"Sets {field}.")  # fmt: skip
    for flag, field in _SPELLINGS.items():
        renamed.add_argument(f"--{flag}", dest=field, action="store_true",
                             default=argparse.SUPPRESS, help=f"Sets {field}.")  # fmt: skip
    for flag, field in _NEGATIONS.items():
        renamed.add_argument(f"--{flag}", dest=field, action="store_false",
                             default=argparse.SUPPRESS, help=f"Clears {field}.")  # fmt: skip
    renamed.add_argument(
        _option(_MTP_PATTERN), dest=_MTP_PATTERN, default=argparse.SUPPRESS, metavar="X",
        help="Megatron-LM's older form of a hybrid model's multi-token prediction layers: "
        "with --mtp-num-layers N and a --hybrid-layer-pattern without '/', the pattern "
        "becomes '<pattern>/X/X...' (N times X); otherwise no effect (Megatron-LM keeps it "
        "for old checkpoints; a GPT model's modules are shaped as its last layer).",
    )  # fmt: skip
    renamed.add_argument(
        _option(_WD_COND), dest=_WD_COND, choices=("apply_wd_to_qk_layernorm",),
        default=argparse.SUPPRESS,
        help="apply_wd_to_qk_layernorm: sets apply_wd_to_qk_layernorm (Megatron-LM's other "
        "spelling of --apply-wd-to-qk-layernorm).",
    )  # fmt: skip
    renamed.add_argument(
        _option(_FSDP_PARAMS), dest=_FSDP_PARAMS, choices=("fp32", "bf16", "fp16", "auto"),
        default=argparse.SUPPRESS,
        help="With --use-megatron-fsdp: the dtype of the parameters the optimizer steps. mp's "
        "FSDP keeps them in fp32 (fp32, or auto for an fp32 model); the others are refused.",
    )  # fmt: skip
    renamed.add_argument(
        _option(_FSDP_OUTER), dest=_FSDP_OUTER, choices=("no_shard", "optim"),
        default=argparse.SUPPRESS,
        help="With --use-megatron-fsdp and --num-distributed-optimizer-instances: what is "
        "sharded across the instances. mp's hybrid sharding replicates there (no_shard, "
        "Megatron's default: FSDP2's HSDP); optim (the optimizer state sharded across them "
        "too) is refused.",
    )  # fmt: skip
    renamed.add_argument(
        _option(_TP_PP_DP), dest=_TP_PP_DP, action="store_true", default=argparse.SUPPRESS,
        help="Sets order to tp-cp-ep-pp-dp (pipeline stages vary faster than data-parallel "
        "replicas), as Megatron-LM's flag does.",
    )  # fmt: skip
    for dest in _FSDP_GRADS:
        renamed.add_argument(
            _option(dest), dest=dest, choices=("fp32", "bf16", "fp16", "auto"),
            default=argparse.SUPPRESS,
            help="With --use-megatron-fsdp: the dtype gradients are accumulated in (main) or "
            "reduced in (comm; auto: the main one). mp's FSDP does both in one dtype: fp32, "
            "or bf16 (--grad-reduce-in-bf16); auto is the model's dtype; fp16 and two "
            "different dtypes are refused.",
        )  # fmt: skip
    refused.add_argument(
        _option(_MODEL_TYPE), dest=_MODEL_TYPE, choices=_MODEL_TYPES, default=argparse.SUPPRESS,
        help="GPTModel, or HybridModel / MambaModel with --hybrid-layer-pattern: what mp "
        "builds from the other flags, so nothing changes; a hybrid type without a pattern "
        "is refused.",
    )  # fmt: skip
    for dest in _FORMATS:
        renamed.add_argument(
            _option(dest), dest=dest, choices=_FORMAT_CHOICES, default=argparse.SUPPRESS,
            help="torch_dist: mp's own checkpoint format (sharded, resharding on load), so the "
            "flag changes nothing; fsdp_dtensor (with --use-megatron-fsdp, as in Megatron-LM): "
            "the same format, which holds FSDP shards too; the other formats are refused (a "
            "legacy Megatron torch checkpoint converts with `mp-ckpt import-megatron SRC DST`).",
        )  # fmt: skip


def _add(group, dest: str, valued: bool, help_text: str) -> None:
    if valued:
        group.add_argument(_option(dest), dest=dest, default=argparse.SUPPRESS, metavar="V",
                           help=help_text)  # fmt: skip
    else:
        group.add_argument(_option(dest), dest=dest, action="store_true",
                           default=argparse.SUPPRESS, help=help_text)  # fmt: skip


def refuse(given: dict[str, Any]) -> None:
    """Raises a ValueError naming the first refused flag among the parsed options, if any."""
    for dest, (_, why) in REFUSED.items():
        if dest in given:
            raise ValueError(f"{_option(dest)}: {why}")
    _refuse_two_data_sources(given)
    if "hybrid_layer_pattern" in given and "hybrid_override_pattern" in given:
        raise ValueError("--hybrid-override-pattern and --hybrid-layer-pattern: give one "
                         "(the first is the second's deprecated name; Megatron-LM refuses "
                         "both)")  # fmt: skip
    model_type = given.pop(_MODEL_TYPE, "GPTModel")
    pattern = given.get("hybrid_layer_pattern", given.get("hybrid_override_pattern"))
    if model_type != "GPTModel" and pattern is None:
        raise ValueError(
            f"{_option(_MODEL_TYPE)} {model_type}: a hybrid model needs its layers, "
            "--hybrid-layer-pattern (M Mamba, * attention, - MLP, E MoE per layer)"
        )


def _refuse_two_data_sources(given: dict[str, Any]) -> None:
    """Megatron-LM's rule: one data source on the command line, mock data, a blend
    (--data-path) or per-split paths. A --mock-data over a YAML file's data path stays a
    way of trying that file's run without its data (docs/configuration.md)."""

    def named(value) -> bool:  # a path, not "none" (the flag's way of clearing one)
        words = value if isinstance(value, list) else [value]
        return bool(value) and [str(w).lower() for w in words] not in (["none"], ["null"])

    splits = ("train_data_path", "valid_data_path", "test_data_path")
    sources = [flag for flag, given_one in (
        ("--mock-data", given.get("mock_data")),
        ("--data-path", named(given.get("data_path"))),
        ("--train/valid/test-data-path", any(named(given.get(name)) for name in splits)),
    ) if given_one]  # fmt: skip
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)}: give a single data source (as "
                         "Megatron-LM asks)")  # fmt: skip


def apply(given: dict[str, Any], values: dict[str, dict[str, Any]]) -> list[str]:
    """Takes the flags above out of `given` (the parsed options), sets the fields the
    renamed ones stand for in `values` (part -> field -> value) and returns the ignored
    flags given; a refused format raises a ValueError naming it."""
    fsdp = given.get("use_megatron_fsdp", values["optimizer"].get("use_megatron_fsdp"))
    for dest in _FORMATS:
        fmt = given.pop(dest, "torch_dist")
        if fmt == "fsdp_dtensor" and not fsdp:
            raise ValueError(
                f"{_option(dest)} fsdp_dtensor needs --use-megatron-fsdp, as in Megatron-LM "
                "(without it drop the flag: mp's checkpoint format serves every layout)"
            )
        if fmt not in ("torch_dist", "fsdp_dtensor"):
            raise ValueError(
                f"{_option(dest)} {fmt}: mp saves and loads its own torch_dist-style "
                "checkpoints; drop the flag (a Megatron-LM checkpoint in another format "
                "converts with `mp-ckpt import-megatron SRC DST`)"
            )
    for dest, (part, field, _) in RENAMED.items():
        if dest not in given:
            continue
        value = given.pop(dest)
        if field in given and given[field] != value:
            raise ValueError(f"{_option(dest)} {value} and {_option(field)} {given[field]} "
                             "disagree: give one")  # fmt: skip
        values[part][field] = value
    device_draws = given.get("use_device_initialization",
                             values["training"].get("use_device_initialization"))  # fmt: skip
    if given.get("use_cpu_initialization") and device_draws:
        raise ValueError("--use-cpu-initialization and --use-device-initialization "
                         "disagree: give one")  # fmt: skip
    _check_shared_expert_overlap(given, values["model"])
    _megatron_fsdp_grads(given, values)
    if given.pop(_TP_PP_DP, False):
        order = given.get("order", values["parallel"].get("order"))
        if order not in (None, "tp-cp-ep-pp-dp"):
            raise ValueError(f"{_option(_TP_PP_DP)} and --order {order} disagree: give one")
        given["order"] = "tp-cp-ep-pp-dp"
    if given.pop(_WD_COND, None) is not None:
        if given.get("apply_wd_to_qk_layernorm") is False:
            raise ValueError(f"{_option(_WD_COND)} apply_wd_to_qk_layernorm and "
                             "--no-apply-wd-to-qk-layernorm disagree: give one")  # fmt: skip
        values["optimizer"]["apply_wd_to_qk_layernorm"] = True
    if given.get("tp_comm_overlap") and not given.get(
        "sequence_parallel", values["model"].get("sequence_parallel")
    ):
        raise ValueError("--tp-comm-overlap without --sequence-parallel: Megatron-LM overlaps "
                         "tensor-parallel communication with GEMMs only under sequence "
                         "parallelism and refuses it too")  # fmt: skip
    if given.pop(_FSDP_OUTER, "no_shard") != "no_shard":
        raise ValueError(f"{_option(_FSDP_OUTER)} optim: mp's hybrid FSDP replicates across "
                         "the distributed-optimizer instances (no_shard); give no_shard or "
                         "drop the flag")  # fmt: skip
    ignored = [_option(dest) for dest in IGNORED if given.pop(dest, None) is not None]
    if megatron_spec.check(given, values):
        ignored.append("--spec")
    ignored += megatron_cuda_graphs.check(given)
    if _MTP_PATTERN in given and not _unify_mtp_pattern(given.pop(_MTP_PATTERN), given, values):
        ignored.append(_option(_MTP_PATTERN))
    return ignored


def _check_shared_expert_overlap(given: dict[str, Any], model: dict[str, Any]) -> None:
    """Megatron-LM's refusal of --moe-shared-expert-overlap with the shared experts
    recomputed (their recompute cannot run beside the token dispatch there)."""

    def value(field: str) -> Any:
        return given.get(field, model.get(field))

    if (given.get("moe_shared_expert_overlap")
            and value("recompute_granularity") == "selective"
            and "shared_experts" in (value("recompute_modules") or ())
            and value("moe_shared_expert_intermediate_size") is not None):  # fmt: skip
        raise ValueError("--recompute-modules shared_experts cannot work with "
                         "--moe-shared-expert-overlap (Megatron-LM's rule): drop one")  # fmt: skip


def _megatron_fsdp_grads(given: dict[str, Any], values: dict) -> None:
    """Megatron-FSDP's gradient dtypes as grad_reduce_in_bf16, and its main parameters'
    dtype checked (see add_to's help)."""
    params = given.pop(_FSDP_PARAMS, None)
    if params is not None:
        half = given.get("bf16", values["optimizer"].get("bf16")) or given.get(
            "fp16", values["optimizer"].get("fp16"))  # fmt: skip
        if params in ("bf16", "fp16") or (params == "auto" and half):
            raise ValueError(f"{_option(_FSDP_PARAMS)} {params}: mp's FSDP steps fp32 main "
                             "parameters; give fp32 or drop the flag")  # fmt: skip
    main, comm = (given.pop(dest, None) for dest in _FSDP_GRADS)
    if main is None and comm is None:
        return
    optimizer = values["optimizer"]

    def value(field: str) -> Any:
        return given.get(field, optimizer.get(field))

    flags = " and ".join(f"{_option(d)} {v}" for d, v in zip(_FSDP_GRADS, (main, comm),
                                                              strict=True) if v)  # fmt: skip
    if not value("use_megatron_fsdp"):
        raise ValueError(f"{flags}: Megatron-FSDP's gradient dtypes need --use-megatron-fsdp "
                         "(otherwise --grad-reduce-in-bf16 sets bf16 gradients)")  # fmt: skip
    model = "bf16" if value("bf16") else "fp16" if value("fp16") else "fp32"
    main = model if main in (None, "auto") else main
    comm = main if comm in (None, "auto") else comm
    if "fp16" in (main, comm) or main != comm:
        raise ValueError(f"{flags}: mp's FSDP accumulates and reduces gradients in one dtype, "
                         "fp32 or bf16: give one of those (or auto) to both")  # fmt: skip
    bf16 = main == "bf16"
    if bf16 and not value("bf16"):
        raise ValueError(f"{flags}: bf16 gradients need --bf16")
    if "grad_reduce_in_bf16" in given and given["grad_reduce_in_bf16"] != bf16:
        raise ValueError(f"{flags} and --grad-reduce-in-bf16 disagree: give one")
    given["grad_reduce_in_bf16"] = bf16


def _unify_mtp_pattern(module: str, given: dict[str, Any], values: dict) -> bool:
    """Megatron-LM's conversion of --mtp-hybrid-override-pattern into the unified pattern,
    made when --mtp-num-layers is given and the hybrid model's pattern has no "/" (a GPT
    model's modules are shaped as its last layer: no pattern to convert); whether it was
    made."""
    pattern = given.get("hybrid_layer_pattern", values["model"].get("hybrid_layer_pattern"))
    depths = given.get("mtp_num_layers", values["model"].get("mtp_num_layers"))
    if pattern is None or not depths or "/" in pattern:
        return False
    given["hybrid_layer_pattern"] = pattern + "".join(f"/{module}" for _ in range(depths))
    return True
