"""The run's configuration: one dataclass tree, each part defined by the package that owns it.

    RunConfig
      model:       TransformerConfig (mp-layers)   YAML section language_model:
      parallel:    ParallelConfig (mp-state)       YAML section model_parallel:
      gpt:         GPTConfig (here)                top-level fields
      optimizer:   OptimizerConfig (mp-optim)      top-level fields
      data:        DataConfig (mp-data)            top-level fields
      checkpoint:  CheckpointConfig (mp-ckpt)      top-level fields
      training:    TrainingConfig (here)           top-level fields
      logging:     LoggingConfig (logging_config.py) top-level fields

Every field keeps Megatron-LM's name, so `--num-layers` or a Megatron YAML
file maps over. A name may live in several parts (bf16 and fp16 are the
model's and the optimizer's): setting it sets it everywhere. `validate`
checks the rules that span parts and the world size.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from mp_ckpt import CheckpointConfig
from mp_data import DataConfig
from mp_layers import TransformerConfig
from mp_optim import OptimizerConfig
from mp_pipeline import check_microbatch_group, stage_layers
from mp_state import ParallelConfig
from mp_train.configuration.batch_sizes import (
    batch_schedule,
    check_eval_batch,
    running_global_batch,
)
from mp_train.configuration.context_parallel_checks import (
    check_chunked_attention,
    check_hierarchical_context_parallel,
)
from mp_train.configuration.logging_config import LoggingConfig
from mp_train.configuration.phase_config import PhaseConfig, check_phases
from mp_train.configuration.pipeline_segments import check_segments
from mp_train.configuration.rerun_config import RerunConfig
from mp_train.configuration.run_checks import (
    check_exit_signal,
    check_initialization,
    check_optimizer_instances,
    check_resume,
    check_schedule,
    check_sharding,
    check_training_rules,
)
from mp_train.configuration.upcycling_config import UpcyclingConfig, check_upcycling
from mp_train.configuration.validation_config import ValidationConfig, check_validation

__all__ = [
    "GPTConfig",
    "LoggingConfig",
    "RunConfig",
    "TrainingConfig",
    "validate",
]


@dataclass(kw_only=True)
class GPTConfig:
    seq_length: int = 1024
    """Tokens per sample."""

    max_position_embeddings: int | None = None
    """Positions the model supports (learned position embeddings); None: seq_length."""

    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """The layer spec: local (pure torch, always) or transformer_engine (CUDA)."""

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"seq_length={self.seq_length} must be >= 1")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} must be >= 1")


@dataclass(kw_only=True)
class TrainingConfig(RerunConfig, ValidationConfig, PhaseConfig, UpcyclingConfig):
    # The rerun engine's fields (result validation, iterations to skip): rerun_config.py;
    # when and over what evaluation runs: validation_config.py; phases: phase_config.py;
    # a MoE model upcycled from a dense checkpoint: upcycling_config.py.

    micro_batch_size: int = 1
    """Samples per micro-batch on one data-parallel rank."""

    global_batch_size: int | None = None
    """Samples per iteration over all data-parallel ranks; None: micro_batch_size x dp."""

    rampup_batch_size: list[int] | None = None
    """Start size, increment and ramp samples: the global batch grows from the start size by
    the increment, evenly over the ramp samples (Megatron's --rampup-batch-size)."""

    step_batch_size_schedule: str | None = None
    """The global batch by consumed tokens, "THRESHOLD:SIZE ..." with K, M, B, T suffixes
    (Megatron's; "0:384 200B:768 400B:1152": 384 samples per iteration, 768 from 200
    billion tokens on, ...). Not with global_batch_size or rampup_batch_size. A size must
    divide by micro_batch_size x dp when the run reaches it."""

    microbatch_group_size_per_virtual_pipeline_stage: int | None = None
    """The interleaved schedule (virtual pipeline stages) runs the micro-batches through
    each model chunk in groups of this many (Megatron's flag; None: the pipeline size).
    Between the pipeline size and the micro-batches per iteration, whose remainder by it
    must be 0 or at least the pipeline size; so a number of micro-batches that is not a
    multiple of the pipeline size runs with a group size that fits it."""

    overlap_p2p_comm: bool = field(
        default=True,
        metadata={"argparse_meta": {"names": ["--overlap-p2p-communication"],
                                    "negatives": ["--no-overlap-p2p-communication"]}},
    )  # fmt: skip
    """The interleaved schedule (virtual pipeline stages) posts each exchange of its
    steady state after the step that computes what it sends, and waits for it only
    before the step that needs what it receives: a forward's activations travel while
    the backward computes, its gradients while the next forward computes (Megatron-LM's,
    on by default there too; --no-overlap-p2p-communication waits for each exchange as
    it is posted). No effect without virtual stages, as in Megatron-LM: 1F1B waits for
    each exchange. Megatron-LM refuses the interleaved schedule at pipeline size 2
    without it (its exchanges there would pair two messages with one rank in one batch);
    mp's exchanges keep the two directions apart and run it."""

    overlap_p2p_comm_warmup_flush: bool = field(
        default=False,
        metadata={"argparse_meta": {"names": ["--overlap-p2p-communication-warmup-flush"]}},
    )
    """overlap_p2p_comm in the interleaved schedule's warm-up and flush too: a rank posts
    the receive of its next step before computing this one (Megatron-LM's). Needs
    overlap_p2p_comm and virtual pipeline stages."""

    train_iters: int | None = None
    """Iterations to train (or train_samples)."""

    train_samples: int | None = None
    """Samples to train (or train_iters)."""

    eval_interval: int | None = 1000
    """Evaluate every this many iterations (None: never)."""

    eval_iters: int = 100
    """Iterations (global batches) per evaluation."""

    eval_micro_batch_size: int | None = None
    """Samples per micro-batch in evaluation (Megatron's); None: micro_batch_size."""

    eval_global_batch_size: int | None = None
    """Samples per evaluation iteration over all data-parallel ranks (Megatron's); a multiple
    of eval_micro_batch_size x dp. None: the training's global batch at that point."""

    skip_train: bool = False
    """Only evaluate (the optimizer's state is not loaded: it sets no_load_optim, as
    Megatron-LM does)."""

    exit_interval: int | None = None
    """Exit after an iteration divisible by this (saving first)."""

    exit_duration_in_mins: float | None = None
    """Exit (saving first) once the job has run this long, counted from its processes'
    start as Megatron's (set-up included); also checked after each evaluation batch (an
    evaluation cut short is not reported). 0: no limit (Megatron's)."""

    exit_signal_handler: bool = False
    """On exit_signal (SIGTERM) every rank finishes its iteration, saves and exits 0."""

    exit_signal: str = "SIGTERM"
    """The signal exit_signal_handler acts on, by name (Megatron's --exit-signal): SIGTERM,
    SIGUSR1 (a scheduler's early warning, e.g. SLURM's --signal=USR1@120), SIGINT, ..."""

    exit_signal_handler_for_training: bool = False
    """SIGINT or SIGTERM ends the rank at once, with one line and exit status 0, instead of
    a traceback or a kill (Megatron's orderly shutdown: no save, for that see
    exit_signal_handler); a background save in flight is finished first."""

    hang_timeout_minutes: float | None = None
    """When no rank has finished an iteration for this long, log which rank is stuck, dump
    every rank's Python stacks and end the job (exit code 1); below
    distributed_timeout_minutes. The clock starts at the first finished iteration and
    pauses during checkpoint saves. None: half of distributed_timeout_minutes (5 of the
    default 10); 0: no hang detection."""

    seed: int = 1234
    """Random seed of the run."""

    deterministic_mode: bool = False
    """Megatron's --deterministic-mode, at start-up (mp_state.apply_deterministic_mode)."""

    cpu_batch_scheduling: bool = True
    """On a CPU run under Linux, every thread of the rank's process is put under
    SCHED_BATCH at start-up, and the threads and processes it starts inherit it: gloo's
    threads, woken by a peer's data, then no longer preempt the rank's thread that holds
    the lock they need and spin until it runs again (loop/cpu_scheduling.py). A two-rank
    TP2 run of tiny.yaml on a 2-core CPU steps 1.3x to 1.9x faster. A policy set before
    the run (chrt, a job scheduler) is kept; False keeps the process's policy always.
    apps/gpt's Generator (generation, the server) does the same on a CPU."""

    lazy_mpu_init: bool = False
    """Megatron's --lazy-mpu-init: mp_train.initialize() does not start torch.distributed,
    the rank groups and the seeds; it returns a function that does, for a launcher that
    starts the process group itself (an external process-group manager) and calls it
    afterwards. pretrain() initializes at once either way."""

    data_parallel_random_init: bool = False
    """Initialize each data-parallel replica differently (then synchronize from rank 0)."""

    init_model_with_meta_device: bool = False
    """Under ZeRO-2/3: never build a whole model chunk, nor a layer's weight whole. Each
    transformer layer is built with its weight matrices on the meta device and sharded over
    the data-parallel ranks before the next one exists; each rank then draws only its
    shards' rows, so it holds no layer weight whole (on one pipeline stage no weight
    matrix at all: the embedding and output layer are drawn so too). The weights are
    those of any other layout for the same seed, bitwise: the whole draw's rows, replayed
    (docs/fsdp.md)."""

    use_device_initialization: bool = False
    """Build the model on the run's device and draw its weights there, from the device's
    generator (mp_layers.building_on), instead of drawing every weight on the CPU (about
    4.6 ns a number on one core: over half a minute for an 8B model) and moving the
    model. The model is still the same at every tensor-parallel size, but not the
    CPU-drawn one, and another GPU model may draw another. On a CPU run it changes
    nothing. Not with init_model_with_meta_device, whose shards are replayed from the CPU
    generator. mp's flag; Megatron draws on the GPU by default, per tensor-parallel rank,
    unless --use-cpu-initialization."""

    no_initialization: bool = False
    """Build the model's weights undrawn (Megatron's --no-initialization: start-up
    without the CPU draws, most of it on a GPU) for the checkpoint that load or
    pretrained_checkpoint starts from to fill. Needs one of them; the run stops if it
    loads nothing or the checkpoint lacks a key of the model (where a drawn weight would
    have stayed). Not with init_model_with_meta_device, which draws each shard as it is
    made."""

    manual_gc: bool = False
    """Disable Python's automatic garbage collection and collect every manual_gc_interval."""

    manual_gc_interval: int = 0
    """Iterations between manual collections (0: none after the one at the start)."""

    manual_gc_eval: bool = True
    """With manual_gc, collect before each evaluation during training and collect its
    youngest generation after it (Megatron's)."""

    decrease_batch_size_if_needed: bool = False
    """Train with the largest multiple of micro_batch_size x the data-parallel size below
    global_batch_size when that does not divide it (a restart on fewer ranks; Megatron's):
    the learning-rate schedule keeps global_batch_size's sample counts, each iteration
    consumes the smaller batch and counts the rest as skipped samples. Not with a batch-size
    ramp or step schedule."""

    train_sync_interval: int | None = None
    """Wait for the GPU every this many iterations (torch.cuda.synchronize, Megatron's), so
    the host never runs far ahead of it. A CPU run has nothing to wait for."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Hand the CUDA caching allocator's unused blocks back to the device
    (torch.cuda.empty_cache), as Megatron does: 1 after each iteration's forward and
    backward and after each evaluation step, 2 also after each optimizer step. Less
    fragmentation for slower steps. No effect on a CPU, which has no caching allocator."""

    check_for_nan_in_loss_and_grad: bool = True
    """Check each micro-batch's loss for nan and inf. With rerun_mode validate_results (the
    default) a failed check from the job's second iteration on runs the iteration again
    (rerun_mode); otherwise the run stops, naming the rank. Off under fp16 with dynamic
    loss scaling (no loss_scale), whose scaler skips such steps (Megatron-LM's rule)."""

    check_weight_hash_across_dp_replicas_interval: int | None = None
    """Every N iterations, stop naming the parameters whose bytes differ between data-parallel
    replicas (Megatron's; loop/replica_check.py; refused under FSDP). None: never."""

    skip_nan_loss_iterations: bool = False
    """Instead of stopping, skip the optimizer step of an iteration with a nan or inf loss."""

    torch_compile: bool = False
    """Compile each transformer layer with torch.compile (inductor; regional: parameter
    names and checkpoints unchanged). The first iteration includes the compilation (its
    time is logged). Inside the compiled layers, context-parallel ring attention (p2p,
    all_gather), the blocked attention, MoE MLPs, selective recompute and dropout on the
    tensor-parallel random stream run eagerly. Training and evaluation only: generation
    is not compiled."""


@dataclass(kw_only=True)
class RunConfig:
    model: TransformerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gpt: GPTConfig = field(default_factory=GPTConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @staticmethod
    def parts() -> dict[str, type]:
        """Part name -> its dataclass, in order."""
        hints = typing.get_type_hints(RunConfig)
        return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Every part's fields (plain values), for logs and checkpoints."""
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in self.parts()}


def validate(config: RunConfig, world_size: int) -> dict[str, int]:
    """Checks the rules spanning parts; returns the derived sizes (data_parallel_size,
    global_batch_size, running_global_batch_size: the one trained with, smaller under
    decrease_batch_size_if_needed; num_microbatches). Raises ValueError naming fields and
    values."""
    parallel, training = config.parallel, config.training
    check_model_parallel(config)
    model_parallel = (
        parallel.tensor_model_parallel_size
        * parallel.pipeline_model_parallel_size
        * parallel.context_parallel_size
    )
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size="
            f"{parallel.tensor_model_parallel_size} x pipeline_model_parallel_size="
            f"{parallel.pipeline_model_parallel_size} x context_parallel_size="
            f"{parallel.context_parallel_size}: launch a multiple of {model_parallel} ranks "
            "or lower these sizes"
        )
    dp = world_size // model_parallel
    mbs = training.micro_batch_size
    if mbs < 1:
        raise ValueError(f"micro_batch_size={mbs} must be >= 1")
    schedule = batch_schedule(config)
    if schedule is not None:
        gbs = max(size for _, size in schedule)
    else:
        gbs = training.global_batch_size if training.global_batch_size is not None else mbs * dp
    if training.decrease_batch_size_if_needed and (schedule or training.rampup_batch_size):
        raise ValueError(
            "decrease_batch_size_if_needed decreases a constant global batch: not with "
            + ("step_batch_size_schedule" if schedule else "rampup_batch_size")
        )
    if gbs < 1:
        raise ValueError(f"global_batch_size={gbs} must be >= 1")
    requested = gbs
    if schedule is None:
        gbs = running_global_batch(training, gbs, dp)
    if (training.train_iters is None) == (training.train_samples is None):
        raise ValueError(
            "give exactly one of train_iters and train_samples, got "
            f"train_iters={training.train_iters} and train_samples={training.train_samples}"
        )
    if training.rampup_batch_size is not None:
        if len(training.rampup_batch_size) != 3:
            raise ValueError(
                f"rampup_batch_size={training.rampup_batch_size} must be [start, increment, "
                "ramp samples]"
            )
        if training.train_samples is None:
            raise ValueError("rampup_batch_size needs train_samples (Megatron's rule)")
    model, optimizer = config.model, config.optimizer
    if model.bf16 and model.fp16:
        raise ValueError("bf16=True and fp16=True are exclusive: choose one")
    if (model.bf16, model.fp16) != (optimizer.bf16, optimizer.fp16):
        raise ValueError(
            f"the model (bf16={model.bf16}, fp16={model.fp16}) and the optimizer "
            f"(bf16={optimizer.bf16}, fp16={optimizer.fp16}) disagree on the precision"
        )
    if optimizer.bf16 and not (optimizer.grad_reduce_in_fp32 or optimizer.grad_reduce_in_bf16):
        raise ValueError("bf16 needs gradients accumulated in fp32")
    check_training_rules(config)
    vpp = parallel.virtual_pipeline_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    layers = model.num_layers
    segmented = check_segments(config)
    first = parallel.decoder_first_pipeline_num_layers
    last = parallel.decoder_last_pipeline_num_layers
    if not segmented and (first is not None or last is not None):
        try:  # the given ends, the rest evenly over the middle stages (Megatron's rule)
            stage_layers(layers, pp, 0, virtual_pipeline_model_parallel_size=vpp,
                         num_layers_in_first_pipeline_stage=first,
                         num_layers_in_last_pipeline_stage=last)  # fmt: skip
        except ValueError as error:
            raise ValueError(
                f"decoder_first_pipeline_num_layers={first} and "
                f"decoder_last_pipeline_num_layers={last}: {error}"
            ) from None
        free = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if free and rest < free:  # Megatron-LM's rule: every stage holds a layer
            raise ValueError(
                f"decoder_first_pipeline_num_layers={first} and decoder_last_pipeline_num_"
                f"layers={last} leave {rest} of num_layers={layers} for the other {free} "
                f"pipeline stage{'s' * (free > 1)}: each needs a layer (Megatron-LM's rule)"
            )
    elif not segmented and layers % (pp * (vpp or 1)):
        raise ValueError(
            f"num_layers={layers} is not divisible by pipeline_model_parallel_size={pp} x "
            f"virtual_pipeline_model_parallel_size={vpp or 1}"
        )
    microbatches = gbs // (mbs * dp)
    group = training.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None and vpp is None:
        raise ValueError(
            f"microbatch_group_size_per_virtual_pipeline_stage={group} sets the interleaved "
            "schedule's groups: it needs virtual_pipeline_model_parallel_size"
        )
    if training.overlap_p2p_comm_warmup_flush and (vpp is None or not training.overlap_p2p_comm):
        raise ValueError(
            "overlap_p2p_comm_warmup_flush overlaps the interleaved schedule's warm-up and "
            "flush exchanges as overlap_p2p_comm does its steady state's: it needs "
            "virtual_pipeline_model_parallel_size and overlap_p2p_comm (Megatron-LM "
            "refuses it without them too)"
        )
    if vpp is not None:
        sizes = [gbs] if schedule is None else [n for _, n in schedule if n % (mbs * dp) == 0]
        for size in sizes:
            try:
                check_microbatch_group(size // (mbs * dp), pp, group or pp)
            except ValueError as error:
                raise ValueError(
                    f"{error} (the micro-batches per iteration: {size // (mbs * dp)} = "
                    f"global_batch_size {size} / (micro_batch_size {mbs} x dp {dp}))"
                ) from None
    if config.gpt.transformer_impl == "transformer_engine":
        raise ValueError(
            "transformer_impl='transformer_engine' is not available: the Transformer Engine "
            "layer spec needs CUDA and transformer-engine; use transformer_impl='local'"
        )
    check_eval_batch(training, gbs if schedule is None else None, dp, pp, vpp)
    if training.eval_interval is not None and training.eval_interval < 1:
        raise ValueError(f"eval_interval={training.eval_interval} must be >= 1 (or None)")
    check_validation(training, config.data)
    check_phases(training)
    check_upcycling(training, config.model, config.checkpoint)
    check_exit_signal(training.exit_signal)
    if (
        training.exit_signal_handler_for_training
        and training.exit_signal_handler
        and (training.exit_signal in ("SIGINT", "SIGTERM"))
    ):
        raise ValueError(
            f"exit_signal_handler_for_training and exit_signal_handler both act on "
            f"{training.exit_signal}: the first ends the run at once, the second saves "
            "first; give one (or another exit_signal)"
        )
    if training.train_sync_interval is not None and training.train_sync_interval < 1:
        raise ValueError(f"train_sync_interval={training.train_sync_interval} must be >= 1")
    hang = training.hang_timeout_minutes
    if hang is not None and hang < 0:
        raise ValueError(f"hang_timeout_minutes={hang} must be >= 0 (0: no hang detection)")
    if hang and hang >= parallel.distributed_timeout_minutes:
        raise ValueError(
            f"hang_timeout_minutes={hang} must be below distributed_timeout_minutes="
            f"{parallel.distributed_timeout_minutes}: a hang would end in the collective's "
            "timeout first, without naming the stuck rank"
        )
    if not config.data.has_data and not training.skip_train:
        raise ValueError("no training data: set data_path, train_data_path or mock_data")
    check_schedule(config)
    check_sharding(config)
    check_optimizer_instances(config, world_size)
    check_initialization(config)
    check_resume(config)
    return {"data_parallel_size": dp, "global_batch_size": requested,
            "running_global_batch_size": gbs, "num_microbatches": microbatches}  # fmt: skip


def hang_timeout_minutes(config: RunConfig) -> float:
    """The hang watchdog's timeout: hang_timeout_minutes, or half of
    distributed_timeout_minutes when None; 0: no hang detection."""
    hang = config.training.hang_timeout_minutes
    return config.parallel.distributed_timeout_minutes / 2 if hang is None else hang


def check_model_parallel(config: RunConfig) -> None:
    """The rules of the tensor, context and expert parallel sizes for a training run (the
    model's own, TransformerConfig.check_parallel, and those of training); raises
    ValueError naming them."""
    parallel = config.parallel
    cp = parallel.context_parallel_size
    config.model.check_parallel(
        parallel.tensor_model_parallel_size, cp, parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size,
    )  # fmt: skip
    tp = parallel.tensor_model_parallel_size
    if config.model.num_moe_experts is not None and tp > 1 and not config.model.sequence_parallel:
        raise ValueError(  # Megatron-LM's rule for training (generation runs without SP)
            f"num_moe_experts with tensor_model_parallel_size={tp} needs "
            "sequence_parallel=True (each tensor-parallel rank routes its own tokens)"
        )
    if parallel.expert_tensor_parallel_size != parallel.tensor_model_parallel_size and (
        config.model.num_moe_experts is None
    ):
        # Megatron-LM's own test lines set it on dense models: it builds the expert groups
        # (mp-state too, with the same divisibility rule) and uses them nowhere.
        warnings.warn(
            f"expert_tensor_parallel_size={parallel.expert_tensor_parallel_size} without "
            "num_moe_experts: a dense model has no experts, so it changes nothing "
            "(Megatron-LM accepts it there too)",
            stacklevel=2,
        )
    check_chunked_attention(config)
    check_hierarchical_context_parallel(config)
    padded, tp = config.data.padded_vocab_size, parallel.tensor_model_parallel_size
    if padded is not None and padded % tp:
        raise ValueError(
            f"padded_vocab_size={padded} is not divisible by tensor_model_parallel_size={tp}: "
            "each tensor-parallel rank holds an equal slice of the vocabulary"
        )
    if cp == 1:
        return
    seq = config.gpt.seq_length
    if seq % (2 * cp):
        raise ValueError(
            f"seq_length={seq} is not divisible by 2 x context_parallel_size={cp}: each "
            "context-parallel rank holds two equal chunks of every sequence"
        )


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)
