"""LoggingConfig: what a run logs and where (Megatron-LM's logging, TensorBoard,
profiling and memory flags), a part of RunConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mp_train.observability.log_setup import parse_level

__all__ = ["LoggingConfig"]


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 100
    """Print a line every this many iterations (and write the timing scalars to
    TensorBoard; the other scalars follow tensorboard_log_interval)."""

    tensorboard_dir: str | None = None
    """Write TensorBoard events here (last rank), with Megatron-LM's tag names."""

    tensorboard_log_interval: int = 1
    """Write the per-iteration TensorBoard scalars every this many iterations."""

    log_progress: bool = False
    """Append job starts, saves (with job and cumulative TFLOP/s per rank, operations and
    tokens) and deletions to progress.txt in the save directory, as Megatron-LM does
    (observability/progress_log.py)."""

    moe_per_layer_logging: bool = False
    """Also write each layer's MoE auxiliary losses to TensorBoard and W&B every iteration,
    as `moe/<name>_layer_<i>` (Megatron's tags: i the layer's 0-based number in the model,
    0 for a layer without experts; the MTP modules' layers after the model's), beside the
    averages; the printed line keeps the averages only."""

    tensorboard_queue_size: int = 1000
    """Events TensorBoard's writer holds before one of them forces a write to disk."""

    log_timers_to_tensorboard: bool = False
    """Write iteration-time, throughput and the timers (<name>-time) to TensorBoard, every
    log_interval."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write each validation value's perplexity (`<name> validation ppl`) to TensorBoard."""

    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale (loss-scale) to TensorBoard."""

    log_learning_rate_to_tensorboard: bool = True
    """Write the learning rate (learning-rate) to TensorBoard."""

    log_batch_size_to_tensorboard: bool = True
    """Write the global batch size (batch-size) to TensorBoard."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size (world-size) to TensorBoard."""

    log_memory_to_tensorboard: bool = False
    """Write memory to TensorBoard: CUDA's reserved, allocated, peak allocated bytes and
    allocation count (mem-*); on CPUs the process's resident and peak resident bytes as
    mem-allocated-bytes and mem-max-allocated-bytes."""

    profile: bool = False
    """Profile iterations profile_step_start to profile_step_end - 1 with torch.profiler
    (CPU activities, and CUDA on GPUs) on the profile_ranks; each rank's trace goes to
    tensorboard_dir as rank<N>.<time>.pt.trace.json."""

    use_pytorch_profiler: bool = False
    """Megatron-LM's choice of torch.profiler for --profile; accepted, and changes nothing:
    mp profiles with torch.profiler only (for Nsight Systems, run under nsys)."""

    pytorch_profiler_collect_shapes: bool = False
    """With profile, record the operators' input shapes in the trace (record_shapes)."""

    pytorch_profiler_collect_callstack: bool = False
    """With profile, record each operator's Python call stack in the trace (with_stack)."""

    pytorch_profiler_collect_chakra: bool = False
    """With profile, also write the profiled iterations' execution trace (torch's
    ExecutionTraceObserver, the graph Chakra reads) to tensorboard_dir/chakra/rank<N>.json."""

    profile_step_start: int = 10
    """The first iteration profiled (with profile)."""

    profile_step_end: int = 12
    """The iteration at which profiling stops, not itself profiled (with profile)."""

    profile_ranks: list[int] = field(default_factory=list)
    """Global ranks that profile; empty: every rank."""

    wandb_project: str | None = None
    """Log to Weights & Biases as well, when wandb is installed."""

    wandb_exp_name: str | None = None
    """The run's name in Weights & Biases."""

    wandb_entity: str | None = None
    """The Weights & Biases entity (team or user) the project belongs to."""

    wandb_save_dir: str | None = None
    """Where Weights & Biases keeps its local files (its `dir`)."""

    metrics_file: str | None = None
    """Append every iteration's reported losses, learning rate and gradient norm here as
    JSON lines, at full precision (last rank)."""

    log_params_norm: bool = False
    """Log the norm of all parameters (each logical parameter counted once)."""

    log_throughput: bool = True
    """Log tokens/s, FLOP/s per rank and MFU."""

    log_memory: bool = True
    """Log current and peak memory."""

    log_device_memory_used: bool = False
    """Also log the memory in use on the whole device, by every process (Megatron's: what
    nvidia-smi shows, torch.cuda.device_memory_used); on a CPU the host's memory in use
    (MemTotal - MemAvailable of /proc/meminfo)."""

    record_memory_history: bool = False
    """Record the CUDA caching allocator's history (allocations and frees with their Python
    stacks, the newest 100,000) from before the model is built, on the profile_ranks
    (empty: every rank); the last rank writes it to memory_snapshot_path at every
    log_interval, and a rank that runs out of memory writes its own beside it
    (<name>_oom_rank-<N><ext>), for torch's memory_viz. Needs a CUDA device."""

    memory_snapshot_path: str = "snapshot.pickle"
    """Where record_memory_history's snapshot goes."""

    log_memory_interval: int | None = None
    """Also print the memory report (peak measured beside the theoretical estimate), which
    comes after the first log_interval iterations, every this many iterations: a multiple
    of log_interval (Megatron's rule). Needs log_memory."""

    peak_tflops: float | None = None
    """The device's peak TFLOP/s per rank for MFU; None: looked up on known GPUs, else
    measured (on a CPU the faster of a bf16 and an fp32 matmul, the best of 3 rounds;
    measured again if a logged interval passes it). An MFU above 1 is not shown (one line
    says so)."""

    timing_log_level: int = 0
    """0: iteration time only; 1: also the main phases; 2: everything timed."""

    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """How timers are reported across ranks."""

    logging_level: int | None = field(
        default=None, metadata={"argparse_meta": {"type": parse_level}}
    )
    """Python logging level of rank 0 and the last rank: a number (10 debug, 20 info, 30
    warning) or, on the command line, a name; None: 20 (info). Other ranks show warnings."""

    barrier_with_L1_time: bool = True
    """Put a barrier before starting level-1 timers (comparable times, some cost)."""

    log_straggler: bool = False
    """Every log_interval, print each rank's forward-step time per iteration across ranks
    (min, median, max) and name the slowest ranks. A rank's forward steps (its batches and
    model forwards) are timed, not its whole iteration, which the loss's and gradients'
    collectives make equal on every rank; on GPUs the device is synchronized around each
    micro-batch's forward step."""

    straggler_minmax_count: int = 1
    """With log_straggler, how many of the slowest (and of the fastest) ranks to name."""

    def __post_init__(self) -> None:
        for name in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size",
                     "straggler_minmax_count"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        every = self.log_memory_interval
        if every is not None and (every < 1 or every % self.log_interval):
            raise ValueError(f"log_memory_interval={every} must be a multiple of "
                             f"log_interval={self.log_interval}")  # fmt: skip
        if every is not None and not self.log_memory:
            raise ValueError(f"log_memory_interval={every} reports memory: it needs "
                             "log_memory (drop --no-log-memory)")  # fmt: skip
        if not self.profile:
            return
        if not self.tensorboard_dir:
            raise ValueError("profile=True needs tensorboard_dir: the profiler's traces are "
                             "written there")  # fmt: skip
        if not 0 <= self.profile_step_start < self.profile_step_end:
            raise ValueError(
                f"profile_step_start={self.profile_step_start} and profile_step_end="
                f"{self.profile_step_end}: need 0 <= profile_step_start < profile_step_end"
            )
