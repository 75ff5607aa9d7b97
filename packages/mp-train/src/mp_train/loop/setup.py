"""Everything a run builds before its first iteration, held in one object.

    run = setup_run(config, model_provider)

initializes (see initialize()) torch.distributed from torchrun's environment (NCCL on GPUs,
gloo on CPUs; a one-rank world without torchrun), the rank groups
(mp_state), the seeds, the tokenizer and padded vocabulary, this rank's
model chunks wrapped in DistributedDataParallel (FullyShardedDataParallel for ZeRO-2/3),
the optimizer and the scheduler. Nothing is kept in module globals: the loop's mutable state is
`run.train` (TrainState).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import mp_state
from mp_data import build_tokenizer, vocab_size_with_padding
from mp_layers import (
    TransformerLayer,
    building_on,
    compile_layers,
    on_layer_built,
    skipping_draws,
)
from mp_optim import (
    DistributedDataParallel,
    FsdpSharding,
    FullyShardedDataParallel,
    InstanceGroups,
    MixedPrecisionOptimizer,
    OptimizerParamScheduler,
    broadcast_params,
    get_optimizer,
    get_optimizer_param_scheduler,
    is_expert_parallel,
)
from mp_pipeline import PipelineConfig, finalize_model_grads, stage_layers
from mp_state import ParallelState, RNGStatesTracker
from mp_train.configuration.config import RunConfig, validate
from mp_train.configuration.pipeline_segments import pipeline_segments
from mp_train.loop.cpu_allocator import keep_freed_memory
from mp_train.loop.cpu_scheduling import batch_scheduling
from mp_train.loop.microbatches import MicroBatchCalculator, parse_batch_schedule
from mp_train.observability.log_setup import configure_logging
from mp_train.observability.memory import start_memory_history
from mp_train.observability.progress_log import ProgressLog
from mp_train.observability.timers import Timers

__all__ = ["Initialized", "ModelProvider", "Run", "TrainState", "initialize", "setup_run"]

log = logging.getLogger("mp_train")

SETUP_TIMERS = ("model-and-optimizer-setup", "train/valid/test-data-iterators-setup")
"""Megatron's two start-up timers: setup_run times the first (the model built,
initialized and wrapped, the optimizer and scheduler), pretrain the second, and pretrain
prints both across the ranks (Timers.report: min and max by default) before the first
iteration."""


@dataclass
class TrainState:
    """The loop's counters: saved in checkpoints, restored on resume."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    skipped_train_samples: int = 0
    """The samples of the iterations skipped by iterations_to_skip (not trained on)."""
    floating_point_operations_so_far: float = 0.0


@dataclass
class Run:
    config: RunConfig
    state: ParallelState
    device: torch.device
    rng_tracker: RNGStatesTracker
    data_parallel_size: int
    calculator: MicroBatchCalculator
    tokenizer: Any
    padded_vocab_size: int
    model: list[DistributedDataParallel] | list[FullyShardedDataParallel]
    optimizer: MixedPrecisionOptimizer
    scheduler: OptimizerParamScheduler
    pipeline: PipelineConfig
    timers: Timers
    train: TrainState = field(default_factory=TrainState)
    has_train_data: bool = False
    has_valid_data: bool = False
    has_test_data: bool = False
    compiled_layers: int = 0
    """The transformer layers this rank compiled (torch_compile)."""
    family: str | None = None
    """The model family (mp_ckpt.families) of the checkpoint this run loaded, when that
    checkpoint named one (import-hf records it): its saves name it too, so that export-hf
    of a fine-tuned model needs no --arch."""
    hf_files: dict = field(default_factory=dict)
    """The tokenizer files and generation settings (common["tokenizer"],
    common["generation_config"]) of the Hugging Face model the run started from, when
    the run's tokenizer is that model's: its saves and its export carry them."""
    progress: ProgressLog | None = None
    """The progress log (log_progress with a save directory), which saves report to."""
    rerun: Any = None
    """The rerun engine (loop/rerun.py's RerunMachine), made by pretrain()."""
    exit_code: int = 0
    """The exit code the run asks for: 16 or 17 when the rerun engine ended it."""

    @property
    def is_last_rank(self) -> bool:
        return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    @property
    def is_first_rank(self) -> bool:
        return torch.distributed.get_rank() == 0

    @property
    def on_last_stage(self) -> bool:
        return self.state.pp.rank == self.state.pp.size - 1


ModelProvider = Callable[..., torch.nn.Module]
"""Called with keywords config (RunConfig), state (ParallelState), stage (StageLayers:
layer offset and count, pre_process, post_process), vp_stage, padded_vocab_size and
rng_tracker; returns this rank's model chunk for that (virtual) stage."""


@dataclass(frozen=True)
class Initialized:
    """What initialize() set up: the rank groups, the device, the RNG tracker and the
    sizes derived by validate()."""

    state: ParallelState
    device: torch.device
    rng_tracker: RNGStatesTracker
    sizes: dict[str, int]


def initialize(config: RunConfig) -> Initialized | Callable[[], Initialized]:
    """Megatron's initialize_megatron (collective): torch.distributed from torchrun's
    environment, or the default group already there; the configuration validated against
    the world size; the rank groups; the seeds.

    With config.training.lazy_mpu_init, nothing is initialized now: the returned
    function does it when called, after the caller (an external process-group manager)
    has started torch.distributed its own way."""
    if config.training.deterministic_mode:  # before any communicator or cuBLAS handle
        mp_state.apply_deterministic_mode()
    if config.training.lazy_mpu_init:
        return functools.partial(_initialize_now, config)
    return _initialize_now(config)


def _initialize_now(config: RunConfig) -> Initialized:
    device_info = mp_state.init_distributed(config.parallel.distributed_timeout_minutes,
                                            config.parallel.distributed_backend)  # fmt: skip
    on_cpu = device_info.device.type == "cpu"
    # Before the rank groups: their gloo threads inherit the policy.
    scheduling = batch_scheduling() if on_cpu and config.training.cpu_batch_scheduling else None
    sizes = validate(config, torch.distributed.get_world_size())
    world = torch.distributed.get_world_size()
    configure_logging(config.logging.logging_level, torch.distributed.get_rank(), world)
    state = mp_state.initialize(config.parallel)
    tracker = mp_state.set_random_seeds(
        config.training.seed, state,
        data_parallel_random_init=config.training.data_parallel_random_init,
    )  # fmt: skip
    log.info("torch.distributed initialized: world size %d, backend %s, device %s; seed %d",
             world, device_info.backend, device_info.device, config.training.seed)  # fmt: skip
    if on_cpu:
        log.info("CPU memory allocator: %s", keep_freed_memory())
        log.info("CPU scheduling: %s", scheduling or "left as it is (--no-cpu-batch-scheduling)")
    set_matmul_precision(config.model, device_info.device)
    return Initialized(state, device_info.device, tracker, sizes)


def set_matmul_precision(model, device: torch.device) -> None:
    """Megatron's disable_bf16_reduced_precision_matmul: with bf16 on CUDA, torch's bf16
    matmuls no longer accumulate in reduced precision (a process-wide switch)."""
    exact = model.bf16 and model.disable_bf16_reduced_precision_matmul
    if exact and device.type == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def setup_run(
    config: RunConfig, model_provider: ModelProvider, initialized: Initialized | None = None
) -> Run:
    """Builds the run (collective: every rank calls it); initializes first unless given
    what initialize() (or the function it returned under lazy_mpu_init) set up."""
    if initialized is None:
        initialized = _initialize_now(config)
    state, tracker, sizes = initialized.state, initialized.rng_tracker, initialized.sizes
    data = config.data
    kind = data.tokenizer_type
    if kind is None and data.vocab_size is not None:
        kind = "NullTokenizer"  # token ids given as they are, the last one end-of-document
    if kind is None:
        raise ValueError("the vocabulary is unknown: set tokenizer_type (or vocab_size)")
    tokenizer = build_tokenizer(
        kind, vocab_file=data.vocab_file, merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model, vocab_size=data.vocab_size,
        sft_tokenizer_prompt_format=data.sft_tokenizer_prompt_format,
        null_tokenizer_eod_id=data.null_tokenizer_eod_id,
        null_tokenizer_pad_id=data.null_tokenizer_pad_id,
    )  # fmt: skip
    vocab = tokenizer.vocab_size
    padded = data.padded_vocab_size or vocab_size_with_padding(
        vocab, data.make_vocab_size_divisible_by, config.parallel.tensor_model_parallel_size
    )
    if padded < vocab:
        raise ValueError(
            f"padded_vocab_size={padded} is below the tokenizer's vocabulary of {vocab} tokens"
        )
    timers = Timers(config.logging.timing_log_level, config.logging.timing_log_option)
    timers(SETUP_TIMERS[0]).start(barrier=True)
    # Before the model: its allocations are in the history too.
    start_memory_history(config.logging, torch.distributed.get_rank(), initialized.device)
    model = _build_model(config, state, tracker, padded, model_provider)
    compiled = 0
    if config.training.torch_compile:  # regional: each layer in place, inside DDP's wrapper
        compiled = sum(compile_layers(chunk.module) for chunk in model)
    experts = _any_expert_parameters(model, initialized.device)
    optimizer = get_optimizer(
        config.optimizer, model, mp_group=state.mp,
        expert_mp_group=state.tp_ep_pp if experts else None,
        tp_group=state.tp, expert_tp_group=state.expert_tp,
        mup_width_mult=config.model.mup_width_mult,
    )  # fmt: skip
    training = config.training
    scheduler = get_optimizer_param_scheduler(
        config.optimizer, optimizer, global_batch_size=sizes["global_batch_size"],
        train_iters=training.train_iters, train_samples=training.train_samples,
    )  # fmt: skip
    pipeline = PipelineConfig(
        seq_length=config.gpt.seq_length,
        micro_batch_size=training.micro_batch_size,
        hidden_size=config.model.hidden_size,
        tensor_model_parallel_size=state.tp.size,
        context_parallel_size=state.cp.size,
        sequence_parallel=config.model.sequence_parallel,
        pipeline_dtype=config.optimizer.model_dtype,
        grad_scale_func=optimizer.scale_loss if config.optimizer.fp16 else None,
        no_sync_func=[chunk.no_sync for chunk in model],
        finalize_model_grads_func=functools.partial(finalize_model_grads, state=state),
        calculate_per_token_loss=config.optimizer.calculate_per_token_loss,
        p2p_timeout_s=60.0 * config.parallel.distributed_timeout_minutes,
        microbatch_group_size_per_vp_stage=training.microbatch_group_size_per_virtual_pipeline_stage,
        overlap_p2p_comm=training.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=training.overlap_p2p_comm_warmup_flush,
    )  # fmt: skip
    schedule = None
    if training.step_batch_size_schedule is not None:
        seq = config.gpt.seq_length
        schedule = parse_batch_schedule(training.step_batch_size_schedule, seq)
        if torch.distributed.get_rank() == 0:
            log.info("step batch size schedule: the global batch is %s", ", ".join(
                f"{size} from sample {start:,} ({start * seq:,} tokens)"
                for start, size in schedule))  # fmt: skip
    running = sizes.get("running_global_batch_size", sizes["global_batch_size"])
    if running != sizes["global_batch_size"] and torch.distributed.get_rank() == 0:
        log.info("decrease_batch_size_if_needed: training with global batches of %d, not %d, "
                 "which micro_batch_size=%d x data_parallel_size=%d does not divide", running,
                 sizes["global_batch_size"], training.micro_batch_size,
                 sizes["data_parallel_size"])  # fmt: skip
    calculator = MicroBatchCalculator(
        running, training.micro_batch_size, sizes["data_parallel_size"],
        training.rampup_batch_size, schedule,
        requested_global_batch_size=sizes["global_batch_size"],
    )  # fmt: skip
    timers(SETUP_TIMERS[0]).stop()
    return Run(
        config=config, state=state, device=initialized.device, rng_tracker=tracker,
        data_parallel_size=sizes["data_parallel_size"], calculator=calculator,
        tokenizer=tokenizer, padded_vocab_size=padded, model=model, optimizer=optimizer,
        scheduler=scheduler, pipeline=pipeline, timers=timers, compiled_layers=compiled,
    )  # fmt: skip


def _any_expert_parameters(model: list, device: torch.device) -> bool:
    """Whether any rank holds expert parameters (collective, once): the optimizer's
    reductions of expert gradient norms then run on every rank, or on none."""
    mine = any(is_expert_parallel(p) for chunk in model for p in chunk.parameters())
    flag = torch.tensor(float(mine), device=device)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag > 0)


def _build_model(config, state, tracker, padded_vocab, model_provider) -> list:
    parallel = config.parallel
    vpp = parallel.virtual_pipeline_model_parallel_size
    sharding = None
    if config.optimizer.fully_sharded:
        sharding = FsdpSharding(config.optimizer, state.dp_cp, state.expert_dp,
                                **_instances(state))  # fmt: skip
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = stage_layers(
            config.model.num_layers, state.pp.size, state.pp.rank,
            virtual_pipeline_model_parallel_size=vpp, vp_stage=vp_stage,
            num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
            segments=pipeline_segments(config),
        )  # fmt: skip
        device = mp_state.select_device().device
        with contextlib.ExitStack() as building:
            # init_model_with_meta_device: each layer sharded before the next one is built.
            if config.training.init_model_with_meta_device:
                building.enter_context(on_layer_built(sharding.shard, defer_weights=True))
            elif config.training.no_initialization:  # the checkpoint loaded next fills them
                building.enter_context(skipping_draws())
            if config.training.use_device_initialization:
                building.enter_context(building_on(device))
            module = model_provider(
                config=config, state=state, stage=stage, vp_stage=vp_stage,
                padded_vocab_size=padded_vocab, rng_tracker=tracker,
            )  # fmt: skip
        # Weights left on meta are drawn when sharded.
        module._apply(lambda t, device=device: t if t.is_meta else t.to(device))
        chunks.append(module)
    if config.training.data_parallel_random_init:
        for module in chunks:
            broadcast_params(module, state.dp_cp, state.expert_dp)
    for module in chunks:
        # The last stage's copy of the word embedding (tied output layer, MTP) takes the
        # first stage's weights (collective over the embedding group).
        tied = getattr(module, "embedding_on_last_stage", False)
        ends = getattr(module, "pre_process", False) or getattr(module, "post_process", False)
        if tied and ends and state.embedding is not None and state.pp.size > 1:
            module.sync_tied_embeddings(state.embedding)
    # Wrapped once the replicas agree: FSDP shards what each rank holds.
    wrapping = _resolved_buckets(config.optimizer, chunks)
    return [_wrap(wrapping, module, state, sharding) for module in chunks]


def _resolved_buckets(optimizer, chunks: list):
    """The optimizer config DDP is made with: num_buckets (with overlap_grad_reduce) as
    the bucket size it gives, this rank's parameters (every chunk's) / num_buckets, as
    Megatron resolves it."""
    if optimizer.num_buckets is None:
        return optimizer
    size = None
    if optimizer.overlap_grad_reduce:
        params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        size = max(1, params // optimizer.num_buckets)
    return dataclasses.replace(optimizer, bucket_size=size, num_buckets=None)


def _wrap(config, module, state, sharding):
    """DDP (with or without the distributed optimizer), or FSDP for ZeRO-2/3."""
    groups = {"dp_group": state.dp_cp, "expert_dp_group": state.expert_dp, **_instances(state)}
    if config.fully_sharded:
        return FullyShardedDataParallel(config, module, units=(TransformerLayer,),
                                        sharding=sharding, **groups)  # fmt: skip
    return DistributedDataParallel(config, module, **groups)


def _instances(state) -> dict:
    """The distributed-optimizer instances of DDP's and FSDP's groups (none: empty)."""
    if state.intra_dp_cp is None:
        return {}
    return {
        "instances": InstanceGroups(state.intra_dp_cp, state.inter_dp_cp),
        "expert_instances": InstanceGroups(state.intra_expert_dp, state.inter_expert_dp),
    }
