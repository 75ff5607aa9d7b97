"""Writes cases.json: which Megatron-LM command lines megatron-core 0.19.2 refuses before a
run starts, and why; the reference of test_megatron_refusals.py (which reads the JSON and
needs no Megatron). Run with megatron-core 0.19.2 installed (Python >= 3.12; it runs on a
CPU):

    python generate.py            # -> cases.json beside this file

Each case is a few flags added to BASE (a small GPT on mock data; a later flag wins) and
a world size. Megatron's own parse_args and validate_args read them (the world size from
WORLD_SIZE, as torchrun gives it), then what Megatron's training sets up from them
before it builds anything, each with checks of its own: the micro-batch calculator
(set_global_variables' call), the model's TransformerConfig, the OptimizerConfig and the
DistributedDataParallelConfig. The case records "accepted" with what the command line
came to (`derived`: fields of the TransformerConfig and of the arguments after
validate_args, and the micro-batches per iteration, in the order of the document's
"derived" names), or the stage that refused it
("parse_args", "validate_args", "microbatches", "TransformerConfig", "OptimizerConfig",
"DistributedDataParallelConfig") with the error's first line.

What the machine lacks is stubbed: validate_args asks the GPU's compute capability
(Hopper is answered: 9.0) and Transformer Engine's version (any is recent enough),
OptimizerConfig inspects Transformer Engine's FusedAdam (transformer_engine_adam), and
CUDA_DEVICE_MAX_CONNECTIONS is set as Megatron's launch scripts set it, 1, unless a
case names FSDP (whose rule asks for it unset). BASE turns the RoPE fusion off, which
needs Transformer Engine's kernel (mp ignores the flag).
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import sys
import types
from pathlib import Path

if os.environ.get("PYTHONHASHSEED") != "0":  # Megatron-LM's errors list sets: one order
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

torch.cuda.get_device_properties = lambda *_, **__: types.SimpleNamespace(major=9, minor=0)
torch.cuda.get_device_capability = lambda *_, **__: (9, 0)

import megatron.training.arguments as megatron_arguments  # noqa: E402
from command_lines import CASES, command_line  # noqa: E402  (beside this file)
from megatron.core.num_microbatches_calculator import (  # noqa: E402
    get_num_microbatches,
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
)
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.training import (  # noqa: E402
    get_megatron_ddp_config,
    get_megatron_optimizer_config,
)

megatron_arguments.is_te_min_version = lambda *_, **__: True  # as with a recent TE


@contextlib.contextmanager
def transformer_engine_adam():
    """Transformer Engine's FusedAdam as OptimizerConfig inspects it for the precision-aware
    optimizer (its signature's dtype arguments), importable while the config is built."""

    class FusedAdam:
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None,
                     exp_avg_sq_dtype=None, use_decoupled_grad=False):  # fmt: skip
            pass

    names = ("transformer_engine", "transformer_engine.pytorch",
             "transformer_engine.pytorch.optimizers")  # fmt: skip
    modules = {name: types.ModuleType(name) for name in names}
    modules["transformer_engine"].__version__ = "2.9.0"
    modules["transformer_engine"].pytorch = modules["transformer_engine.pytorch"]
    modules["transformer_engine.pytorch"].optimizers = modules[names[2]]
    modules[names[2]].FusedAdam = FusedAdam
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# What an accepted command line comes to: the model's TransformerConfig fields, then the
# arguments' (after validate_args has derived its values), then the micro-batches.
CONFIG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "kv_channels", "num_attention_heads",
    "num_query_groups", "sequence_parallel", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "gated_linear_unit", "add_bias_linear",
    "add_qkv_bias", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
    "moe_router_score_function", "moe_router_pre_softmax", "hidden_dropout",
    "attention_dropout", "normalization", "layernorm_epsilon", "multi_latent_attention",
    "qk_layernorm", "rotary_interleaved", "window_size", "softmax_type", "init_method_std",
    "mtp_num_layers", "bf16", "fp16", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "calculate_per_token_loss", "moe_router_dtype", "moe_z_loss_coeff",
    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_num_groups",
    "moe_router_group_topk", "moe_input_jitter_eps", "moe_apply_probs_on_input",
    "moe_shared_expert_gate", "moe_latent_size", "activation_func_clamp_value",
    "mtp_loss_scaling_factor", "experimental_attention_variant", "linear_attention_freq",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate",
    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "first_last_layers_bf16", "fp8",
    "fp8_recipe", "cross_entropy_loss_fusion", "deterministic_mode", "qk_clip", "qk_clip_alpha",
    "qk_clip_threshold", "use_mup", "mup_base_hidden_size", "embedding_init_method_std",
    "no_rope_freq",
)  # fmt: skip
ARGS_FIELDS = (
    "data_parallel_size", "global_batch_size", "micro_batch_size", "position_embedding_type",
    "rotary_percent", "rotary_base", "untie_embeddings_and_output_weights",
    "accumulate_allreduce_grads_in_fp32", "check_for_nan_in_loss_and_grad", "train_iters",
    "train_samples", "lr_warmup_iters", "lr_decay_iters", "seq_length",
    "max_position_embeddings", "use_distributed_optimizer", "overlap_grad_reduce",
    "overlap_param_gather", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1",
    "adam_beta2", "adam_eps", "lr_decay_style", "eval_iters", "eval_interval", "no_load_optim",
    "no_load_rng", "finetune", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "log_interval", "exit_interval", "seed", "split",
    "skip_train", "use_checkpoint_args", "exit_on_missing_checkpoint", "save_interval",
    "decoupled_lr", "decoupled_min_lr", "lr_warmup_fraction", "lr_warmup_init",
    "lr_wsd_decay_style", "lr_wsd_decay_iters", "start_weight_decay", "end_weight_decay",
    "weight_decay_incr_style", "optimizer", "sgd_momentum", "manual_gc", "manual_gc_interval",
    "data_parallel_random_init", "distributed_timeout_minutes", "eval_global_batch_size",
    "eval_micro_batch_size", "full_validation", "make_vocab_size_divisible_by",
    "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
    "create_attention_mask_in_dataloader", "num_workers",
)  # fmt: skip


def plain(value):
    """A value as JSON holds it: enums by name, tuples as lists, dtypes as text."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return value


DERIVED = (*CONFIG_FIELDS, *ARGS_FIELDS, "num_microbatches")
"""The names of a `derived` record's values, in order."""


def derived(args, config) -> list:
    values = [plain(getattr(config, name)) for name in CONFIG_FIELDS]
    values += [plain(getattr(args, name)) for name in ARGS_FIELDS]
    return [*values, get_num_microbatches()]


def verdict(flags: str, world_size: int) -> dict:
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    if "fsdp" in flags:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    sys.argv = ["pretrain_gpt.py", *command_line(flags)]
    printed = io.StringIO()
    stage = "parse_args"
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            args = parse_args()
            stage = "validate_args"
            validate_args(args, {})
            stage = "microbatches"
            unset_num_microbatches_calculator()
            init_num_microbatches_calculator(
                rank=0, global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size,
                data_parallel_size=args.data_parallel_size * args.gtp_weight_remat_size,
                decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
                step_batch_size_schedule=args.step_batch_size_schedule,
                seq_length=args.seq_length,
            )  # fmt: skip
            stage = "TransformerConfig"
            config = core_transformer_config_from_args(args)
            stage = "OptimizerConfig"
            with transformer_engine_adam():
                get_megatron_optimizer_config(args)
            stage = "DistributedDataParallelConfig"
            get_megatron_ddp_config(args)
    except SystemExit:  # argparse's error, or validate_args' exit() for a removed flag
        lines = [line for line in printed.getvalue().splitlines() if line.strip()]
        return {"verdict": "refused", "stage": stage, "error": lines[-1] if lines else "exit"}
    except Exception as error:  # every refusal is recorded as it is
        text = str(error).strip().splitlines()
        first = text[0] if text else ""
        return {"verdict": "refused", "stage": stage,
                "error": f"{type(error).__name__}: {first}"[:300]}  # fmt: skip
    return {"verdict": "accepted", "derived": derived(args, config)}


def main() -> None:
    import megatron.core

    names = [name for name, _, _ in CASES]
    assert len(names) == len(set(names)), "case names repeat"
    cases = {
        name: {"flags": flags, "world_size": world, **verdict(flags, world)}
        for name, flags, world in CASES
    }
    out = Path(__file__).with_name("cases.json")
    for case in cases.values():
        case["command_line"] = " ".join(command_line(case["flags"]))
    # A case a line, its derived values listed in the order of "derived".
    lines = [f" {json.dumps(name)}: {json.dumps(case)}" for name, case in cases.items()]
    out.write_text(
        f'{{"megatron_core": {json.dumps(megatron.core.__version__)},\n'
        f'"derived": {json.dumps(list(DERIVED))},\n'
        '"cases": {\n' + ",\n".join(lines) + "\n}}\n"
    )
    refused = sum(case["verdict"] == "refused" for case in cases.values())
    print(f"{len(cases)} cases ({refused} refused) -> {out}")


if __name__ == "__main__":
    main()
