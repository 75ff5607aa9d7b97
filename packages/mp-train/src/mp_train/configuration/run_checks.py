"""Checks of a run's settings that would otherwise fail late, deep in the setup, on every
rank: in the user's terms (the flags they gave, in iterations when they gave iterations).

    check_schedule(config)    the learning-rate schedule in the run's unit (iterations
                              or samples), its warm-up ending before the decay does
    check_sharding(config)    FSDP (ZeRO-2/3) with what it composes with, or the refusal
    check_optimizer_instances(config, world_size)  distributed-optimizer instances with
                              an optimizer that shards, dividing each data-parallel group
    check_training_rules(config)  Megatron-LM's rules of a training run's settings:
                              positions that cover a sample, FP8's bf16 ends within a
                              pipeline stage, no fused loss in deterministic mode, the
                              parameters' all-gather overlapped only with the gradients'
    check_initialization(config)  no_initialization with a checkpoint to load, and
                              device draws not with meta-device shards
    check_resume(config)      override_ckpt_iteration with a constant global batch
    check_tokenizer(config)   a tokenizer type mp has, with the arguments it requires
    check_input_files(config) the data prefixes and tokenizer files exist, and
                              export_hf_dir can take an export
    check_backend(config)     --distributed-backend nccl has CUDA devices to run on,
                              --fp8-format a GPU with FP8 tensor cores (and torchao),
                              --log-device-memory-used a measure of the device's memory,
                              --record-memory-history a CUDA device
    check_exit_signal(name)   --exit-signal names a signal a process can handle

validate() applies the first six; an entry point applies the others (load_config),
before torch.distributed starts: the library's own callers may build their tokenizer
and datasets their own way.
"""

from __future__ import annotations

import os
import signal

from mp_ckpt import check_export_target
from mp_data import TOKENIZER_TYPES, get_blend_from_list
from mp_state import plan_groups
from mp_train.errors import ConfigError, flag

SFT_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SFTTokenizer")
"""The tokenizer types --sft renders conversations with (a tokenizer.json folder)."""

__all__ = [
    "check_backend",
    "check_exit_signal",
    "check_initialization",
    "check_input_files",
    "check_optimizer_instances",
    "check_resume",
    "check_schedule",
    "check_sharding",
    "check_tokenizer",
    "check_training_rules",
]


def check_backend(config) -> None:
    """The backend the run names can start here (nccl needs CUDA), and its FP8 GEMMs can
    run on this device, before any rank starts torch.distributed."""
    import mp_state
    from mp_layers import check_fp8_device

    try:
        device = mp_state.select_device(config.parallel.distributed_backend).device
        check_fp8_device(config.model, device)
        if config.logging.record_memory_history and device.type != "cuda":
            raise ValueError(
                "--record-memory-history records the CUDA caching allocator's history: it "
                f"needs a CUDA device; this rank computes on {device.type}"
            )
        if config.logging.log_device_memory_used:
            from mp_train.observability.memory import device_memory_used

            device_memory_used(device)
    except (ValueError, RuntimeError) as error:
        raise ConfigError(str(error)) from None


def check_schedule(config) -> None:
    """Warm-up shorter than the decay (mp_optim's scheduler would refuse it after the model
    is built, in samples), said in iterations or samples as the run counts."""
    optimizer, training = config.optimizer, config.training
    unit = "iters" if training.train_iters is not None else "samples"
    if not training.skip_train:
        _check_schedule_unit(optimizer, unit)
    decay_name = f"lr_decay_{unit}"
    decay = getattr(optimizer, decay_name)
    if decay is None:
        decay_name = f"train_{unit}"
        decay = getattr(training, decay_name)
    if decay is None:
        return  # validate() reports the missing length
    words = "iterations" if unit == "iters" else "samples"
    decay_flag = f"{flag(decay_name)} {decay}"
    if decay_name.startswith("train_"):
        decay_flag += f" (the decay length without {flag(f'lr_decay_{unit}')})"
    if decay < 1:
        raise ConfigError(f"{decay_flag} must be >= 1: the learning rate decays over {words}")
    if optimizer.lr_warmup_fraction is not None:
        if optimizer.lr_warmup_fraction >= 1:
            raise ConfigError(
                f"--lr-warmup-fraction {optimizer.lr_warmup_fraction} is not below 1: the "
                "warm-up would not end before the decay does; give a fraction below 1"
            )
        return
    warmup_name = f"lr_warmup_{unit}"
    warmup = getattr(optimizer, warmup_name)
    if warmup >= decay:
        raise ConfigError(
            f"{flag(warmup_name)} {warmup} is not below {decay_flag}: warm up for fewer "
            f"{words} or decay over more"
        )


def check_training_rules(config) -> None:
    """Megatron-LM's argument rules for a training run (its validate_args and
    TransformerConfig) that no one part's dataclass can check alone."""
    gpt, model, optimizer = config.gpt, config.model, config.optimizer
    positions, length = gpt.max_position_embeddings, gpt.seq_length
    if positions is not None and positions < length:
        raise ConfigError(
            f"max_position_embeddings={positions} is below seq_length={length}: the model's "
            "positions must cover a sample (Megatron-LM's rule)"
        )
    if model.fp8 is not None and model.first_last_layers_bf16:
        per_stage = model.num_layers // config.parallel.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(model, name) > per_stage:
                raise ConfigError(
                    f"{name}={getattr(model, name)} exceeds a pipeline stage's "
                    f"{per_stage} layers (Megatron-LM's bound)"
                )
    if config.training.deterministic_mode and model.cross_entropy_loss_fusion:
        raise ConfigError("deterministic_mode=True needs cross_entropy_loss_fusion=False "
                          "(Megatron-LM's rule): drop --cross-entropy-loss-fusion")  # fmt: skip
    if optimizer.overlap_param_gather and not optimizer.overlap_grad_reduce:
        raise ConfigError("overlap_param_gather=True needs overlap_grad_reduce=True "
                          "(Megatron-LM's rule for a training run)")  # fmt: skip


def _check_schedule_unit(optimizer, unit: str) -> None:
    """The schedule is said in the run's unit (Megatron-LM's rule, which a run that skips
    training is spared): the other unit's options, which the scheduler would not read,
    are refused, and so is a warm-up given both as a fraction and as a length."""
    other = "samples" if unit == "iters" else "iters"
    run = f"{flag(f'train_{unit}')} run"
    counts = "iterations" if unit == "iters" else "samples"
    if getattr(optimizer, f"lr_decay_{other}") is not None:
        raise ConfigError(
            f"{flag(f'lr_decay_{other}')} in a {run}: the schedule counts {counts}; give "
            f"{flag(f'lr_decay_{unit}')}"
        )
    if getattr(optimizer, f"lr_warmup_{other}"):
        raise ConfigError(
            f"{flag(f'lr_warmup_{other}')} in a {run}: the schedule counts {counts}; "
            f"give {flag(f'lr_warmup_{unit}')} or --lr-warmup-fraction (and "
            f"{flag(f'lr_warmup_{other}')} 0 where a --config file sets it)"
        )
    warmup = getattr(optimizer, f"lr_warmup_{unit}")
    if optimizer.lr_warmup_fraction is not None and warmup:
        raise ConfigError(
            f"--lr-warmup-fraction {optimizer.lr_warmup_fraction} and "
            f"{flag(f'lr_warmup_{unit}')} {warmup} both give the warm-up: give one"
        )


def check_resume(config) -> None:
    """override_ckpt_iteration counts the consumed samples as the iteration x the global
    batch size (Megatron's rule): not under a batch-size ramp or schedule."""
    target, training = config.checkpoint.override_ckpt_iteration, config.training
    if target is None:
        return
    varying = [flag(name) for name in ("rampup_batch_size", "step_batch_size_schedule")
               if getattr(training, name) is not None]  # fmt: skip
    if varying:
        raise ConfigError(
            f"--override-ckpt-iteration {target} counts the samples consumed by then as "
            f"{target} x --global-batch-size, which {varying[0]} does not consume: drop one"
        )


def check_initialization(config) -> None:
    """no_initialization with a checkpoint to fill the weights; neither it nor
    use_device_initialization with init_model_with_meta_device."""
    training, ckpt = config.training, config.checkpoint
    if training.use_device_initialization and training.init_model_with_meta_device:
        raise ConfigError(
            "--use-device-initialization with --init-model-with-meta-device: the meta-device "
            "build replays each shard's rows from the CPU generator; drop one"
        )
    if not training.no_initialization:
        return
    if ckpt.load is None and ckpt.pretrained_checkpoint is None:
        raise ConfigError(
            "--no-initialization needs --load or --pretrained-checkpoint: without a "
            "checkpoint to fill them the weights would be uninitialized memory"
        )
    if training.init_model_with_meta_device:
        raise ConfigError(
            "--no-initialization with --init-model-with-meta-device: the meta-device build "
            "draws each shard as it is made; drop one"
        )


def check_sharding(config) -> None:
    """FSDP (use_megatron_fsdp's optim_grads / optim_grads_params, use_torch_fsdp2) with
    what it cannot run refused by name, and use_torch_fsdp2 with Megatron's own refusals
    (docs/fsdp.md lists both)."""
    optimizer, parallel = config.optimizer, config.parallel
    if config.training.init_model_with_meta_device:
        if not optimizer.fully_sharded:
            raise ConfigError(
                "--init-model-with-meta-device needs ZeRO-2/3 (--use-megatron-fsdp with "
                "--data-parallel-sharding-strategy optim_grads or optim_grads_params, or "
                "--use-torch-fsdp2): without them every rank holds the whole chunk anyway"
            )
        if config.training.data_parallel_random_init:
            raise ConfigError(
                "--init-model-with-meta-device with --data-parallel-random-init: the "
                "broadcast of data-parallel rank 0's weights needs whole layers; drop one"
            )
    if not optimizer.fully_sharded:
        return
    if optimizer.use_torch_fsdp2:
        name = "--use-torch-fsdp2"
        pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
        megatron = {  # Megatron-LM's validation of --use-torch-fsdp2
            f"--pipeline-model-parallel-size {pp}": pp > 1,
            f"--expert-model-parallel-size {ep}": ep > 1,
            "tied input and output embeddings (no --untie-embeddings-and-output-weights)": (
                not config.model.untie_embeddings_and_output_weights
            ),
        }
        for what, given in megatron.items():
            if given:
                raise ConfigError(f"{name} with {what}: not supported, as in Megatron-LM; "
                                  "--use-megatron-fsdp composes with it")  # fmt: skip
    else:
        name = "--use-megatron-fsdp"
    if config.training.check_weight_hash_across_dp_replicas_interval:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval with {name}: the "
                          "data-parallel ranks hold different rows of each parameter, no "
                          "replicas to compare; drop it")  # fmt: skip


def check_optimizer_instances(config, world_size: int) -> None:
    """num_distributed_optimizer_instances > 1: an optimizer that shards (the distributed
    one, or FSDP, then sharded hybridly), not the layer-wise one, and instances that divide
    each data-parallel group (mp-state's plan says which, naming its size)."""
    optimizer, parallel = config.optimizer, config.parallel
    instances = parallel.num_distributed_optimizer_instances
    if instances == 1:
        return
    flag = f"--num-distributed-optimizer-instances {instances}"
    if optimizer.use_layer_wise_distributed_optimizer:
        raise ConfigError(f"{flag} with the layer-wise distributed optimizer: not "
                          "supported, as in Megatron-LM")  # fmt: skip
    if not (optimizer.use_distributed_optimizer or optimizer.fully_sharded):
        raise ConfigError(f"{flag} splits the distributed optimizer: it needs "
                          "--use-distributed-optimizer, or FSDP (ZeRO-2/3, then "
                          "sharded hybridly), as in Megatron-LM")  # fmt: skip
    plan_groups(parallel, world_size)


def check_tokenizer(config) -> None:
    """A tokenizer type mp provides and the arguments it reads (mp_data.TOKENIZER_TYPES)."""
    data = config.data
    kind = data.tokenizer_type
    if data.sft and kind not in SFT_TOKENIZER_TYPES:
        raise ConfigError(
            f"--sft with --tokenizer-type {kind or '(none)'}: conversations are rendered with "
            f"a Hugging Face tokenizer's files; give --tokenizer-type "
            f"{' or '.join(SFT_TOKENIZER_TYPES)} and --tokenizer-model"
        )
    if kind is None:
        if data.vocab_size is None:
            raise ConfigError(
                "the vocabulary is unknown: give --tokenizer-type (or --vocab-size for token "
                "ids used as they are)"
            )
        return
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(
            f"--tokenizer-type {kind} is not one mp has: choose one of {', '.join(TOKENIZER_TYPES)}"
        )
    missing = [flag(name) for name in TOKENIZER_TYPES[kind] if getattr(data, name) is None]
    if missing:
        raise ConfigError(f"--tokenizer-type {kind} needs {' and '.join(missing)}")


def check_input_files(config) -> None:
    """Every dataset prefix (.bin and .idx) and tokenizer file the run will read exists."""
    data = config.data
    if not data.mock_data:
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            blend = get_blend_from_list(getattr(data, name))
            for prefix in blend[0] if blend else ():
                if data.sft:
                    if not os.path.isfile(prefix):
                        raise ConfigError(f"{_named_by(data, name)} {prefix}: no such file "
                                          "(--sft reads JSONL files of conversations)")  # fmt: skip
                    continue
                for suffix in (".bin", ".idx"):
                    if not os.path.isfile(prefix + suffix):
                        raise ConfigError(
                            f"{_named_by(data, name)} {prefix}: {prefix}{suffix} does not "
                            "exist; give the path of a .bin/.idx pair without its extension"
                        )
    kind = data.tokenizer_type
    for name in ("vocab_file", "merge_file"):
        path = getattr(data, name)
        if name in TOKENIZER_TYPES.get(kind, ()) and path is not None and not os.path.exists(path):
            raise ConfigError(f"{flag(name)} {path} does not exist (--tokenizer-type {kind})")
    export = config.checkpoint.export_hf_dir
    if export is not None:
        try:
            check_export_target(export)
        except FileExistsError as error:
            raise ConfigError(str(error).replace("export_hf_dir=", "--export-hf-dir ")) from None


def _named_by(data, name: str) -> str:
    """Where the user gave a data path: its flag, or the file (--data-args-path,
    --per-split-data-args-path) that listed it."""
    listed_in = "data_args_path" if name == "data_path" else "per_split_data_args_path"
    path = getattr(data, listed_in, None)
    return flag(name) if path is None else f"{flag(listed_in)} {path} lists"


_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def check_exit_signal(name: str) -> int:
    """The number of the signal `name` (exit_signal), or a ValueError naming the choices."""
    valid = sorted(s.name for s in signal.Signals if s.name not in _UNCATCHABLE)
    if name not in valid:
        raise ValueError(f"exit_signal={name!r} must be a signal a process can handle, one of "
                         f"{', '.join(valid)}")  # fmt: skip
    return int(signal.Signals[name])
