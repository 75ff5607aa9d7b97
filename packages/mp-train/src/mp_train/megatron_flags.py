"""Megatron-LM flags that have no field of their own in mp: accepted without effect,
accepted as another name of one of ours, or refused with the reason.

A launch line pasted from Megatron-LM carries flags that pick CUDA fusions or
implementations mp does not have or need (mp runs one implementation, whose
numerics each flag's note states), older spellings of flags mp has, and a few
features mp does not implement. Each is listed here once; `add_to(parser)` adds
them to the run's parser (with their notes as help, so `--help` shows them) and
`apply(given, values)` takes them out of the parsed options, setting what they
stand for or raising a ValueError that names the flag and what to do instead.
docs/migrating-from-megatron.md holds the same table for readers.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["IGNORED", "REFUSED", "RENAMED", "add_to", "apply"]

# flag (dest) -> (takes a value, why mp needs nothing for it)
IGNORED: dict[str, tuple[bool, str]] = {
    "use_mcore_models": (False, "mp has one GPT implementation (megatron-core's module layout)"),
    "no_masked_softmax_fusion": (
        False,
        "a CUDA kernel fusion: mp's attention is SDPA or blocked "
        "matmuls, never the fused masked softmax",
    ),
    "no_gradient_accumulation_fusion": (
        False,
        "a CUDA kernel fusion: mp accumulates weight gradients with plain matmuls",
    ),
    "no_bias_swiglu_fusion": (False, "a CUDA kernel fusion: mp computes bias + SwiGLU unfused"),
    "no_bias_gelu_fusion": (False, "a CUDA kernel fusion: mp computes bias + GELU unfused"),
    "no_bias_dropout_fusion": (
        False,
        "a CUDA kernel fusion: mp computes bias + dropout + residual unfused",
    ),
    "no_rope_fusion": (False, "a CUDA kernel fusion: mp applies rotary embeddings unfused"),
    "no_persist_layer_norm": (
        False,
        "selects Apex's persistent LayerNorm kernel, which mp does not use",
    ),
    "attention_softmax_in_fp32": (
        False,
        "mp's attention softmax accumulates in fp32 already (SDPA kernels, torch.softmax)",
    ),
    "cross_entropy_loss_fusion": (
        False,
        "a CUDA kernel fusion: mp's vocabulary-parallel cross entropy computes in fp32 unfused",
    ),
    "no_async_tensor_model_parallel_allreduce": (
        False,
        "a CUDA overlap switch; mp's tensor-parallel reductions are synchronous",
    ),
    "use_cpu_initialization": (
        False,
        "mp always initializes weights on the CPU (the same model at every TP size)",
    ),
    "legacy_tokenizer": (False, "mp has one tokenizer implementation per --tokenizer-type"),
    "mmap_bin_files": (False, "mp always memory-maps .bin files"),
    "no_mmap_bin_files": (False, "mp always memory-maps .bin files"),
    "use_dist_ckpt": (False, "mp's checkpoints are always distributed (torch_dist-style)"),
    "ckpt_fully_parallel_save": (False, "every rank of mp writes its own pieces already"),
    "no_ckpt_fully_parallel_save": (False, "every rank of mp writes its own pieces"),
    "ckpt_fully_parallel_load": (False, "every rank of mp reads only the pieces it needs"),
    "ckpt_assume_constant_structure": (False, "a save-planning cache mp does not need"),
    "no_query_key_layer_scaling": (False, "mp scales attention scores by 1/sqrt(d) only"),
    "no_overlap_p2p_communication": (
        False,
        "mp batches each exchange's pipeline sends and receives and waits for them together",
    ),
}

# flag (dest) -> why mp refuses it and what to do instead
REFUSED: dict[str, tuple[bool, str]] = {
    "use_torch_fsdp2": (False, "FSDP2 is not implemented: shard with --use-distributed-optimizer"),
    "use_megatron_fsdp": (
        False,
        "Megatron FSDP is not implemented: shard with --use-distributed-optimizer",
    ),
    "tp_comm_overlap": (
        False,
        "needs Transformer Engine's userbuffers, which mp does not use: drop it",
    ),
    "grad_reduce_in_bf16": (
        False,
        "mp reduces bf16 gradients in fp32 (Megatron's default): drop it",
    ),
    "apply_query_key_layer_scaling": (
        False,
        "fp16 query-key layer scaling is not implemented: drop it (use bf16)",
    ),
    "fp8_format": (True, "fp8 training is not implemented: use --bf16"),
    "overlap_p2p_communication": (
        False,
        "mp's schedules do not overlap pipeline sends and receives with compute: drop it",
    ),
    "defer_embedding_wgrad_compute": (
        False,
        "mp computes the embedding's weight gradient in its backward, not deferred: drop it",
    ),
    "empty_unused_memory_level": (
        True,
        "mp does not empty the CUDA caching allocator between steps: drop it",
    ),
    "microbatch_group_size_per_virtual_pipeline_stage": (
        True,
        "mp's interleaved schedule groups pipeline_model_parallel_size micro-batches: drop it",
    ),
}

# flag (dest) -> (RunConfig part, field, type): another name (or an older spelling) of a field
RENAMED: dict[str, tuple[str, str, Any]] = {
    "norm_epsilon": ("model", "layernorm_epsilon", float),
    "ddp_bucket_size": ("optimizer", "bucket_size", int),
}
# Megatron's spellings with an underscore inside the flag name: the same fields as ours.
_SPELLINGS = {
    "override-opt_param-scheduler": "override_opt_param_scheduler",
    "use-checkpoint-opt_param-scheduler": "use_checkpoint_opt_param_scheduler",
}
# The checkpoint format flags: mp writes and reads torch_dist-style checkpoints only.
_FORMATS = ("ckpt_format", "dist_ckpt_format")
_FORMAT_CHOICES = ("torch_dist", "torch", "torch_dcp", "zarr", "fsdp_dtensor")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_to(parser: argparse.ArgumentParser) -> None:
    """Adds the flags above to the run's parser, each in a group saying what it does."""
    ignored = parser.add_argument_group(
        "Megatron-LM flags accepted without effect", "Each selects something mp does not have "
        "or need; its help says why the run is the same without it.")  # fmt: skip
    for dest, (valued, why) in IGNORED.items():
        _add(ignored, dest, valued, f"No effect: {why}.")
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
    for dest in _FORMATS:
        renamed.add_argument(
            _option(dest), dest=dest, choices=_FORMAT_CHOICES, default=argparse.SUPPRESS,
            help="torch_dist: mp's own checkpoint format (sharded, resharding on load), so the "
            "flag changes nothing; the other formats are refused (a legacy Megatron torch "
            "checkpoint converts with `mp-ckpt import-megatron SRC DST`).",
        )  # fmt: skip


def _add(group, dest: str, valued: bool, help_text: str) -> None:
    if valued:
        group.add_argument(_option(dest), dest=dest, default=argparse.SUPPRESS, metavar="V",
                           help=help_text)  # fmt: skip
    else:
        group.add_argument(_option(dest), dest=dest, action="store_true",
                           default=argparse.SUPPRESS, help=help_text)  # fmt: skip


def apply(given: dict[str, Any], values: dict[str, dict[str, Any]]) -> list[str]:
    """Takes the flags above out of `given` (the parsed options), sets the fields the
    renamed ones stand for in `values` (part -> field -> value) and returns the ignored
    flags given; a refused flag or format raises a ValueError naming it."""
    for dest, (_, why) in REFUSED.items():
        if dest in given:
            raise ValueError(f"{_option(dest)}: {why}")
    for dest in _FORMATS:
        fmt = given.pop(dest, "torch_dist")
        if fmt != "torch_dist":
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
    return [_option(dest) for dest in IGNORED if given.pop(dest, None) is not None]
