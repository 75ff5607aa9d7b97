"""OptimizerConfig: the optimizer, mixed precision, data-parallel gradients and the LR/WD schedule.

Field names and defaults are Megatron-LM's (its OptimizerConfig,
DistributedDataParallelConfig and the scheduler's command-line arguments), so
a Megatron YAML file or command line maps over. Rules are checked in
__post_init__; every message names the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mp_optim.config_muon import MuonConfig

__all__ = ["OptimizerConfig"]

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
_WD_STYLES = ("constant", "linear", "cosine")
_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(kw_only=True)
class OptimizerConfig(MuonConfig):
    # The optimizer.

    optimizer: Literal["adam", "sgd", "muon", "lion"] = "adam"
    """adam (Adam with decoupled weight decay, i.e. AdamW, as Megatron's fused Adam), sgd,
    muon (matrices by Muon, the other parameters by adam; the muon_* fields), or lion (the
    sign of an interpolated momentum, decoupled weight decay, one state tensor: megatron-
    core's Lion; the lion_* fields)."""

    lr: float | None = None
    """Peak learning rate (reached at the end of warm-up)."""

    min_lr: float = 0.0
    """Learning rate at the end of decay and beyond."""

    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding's and the output layer's weights
    (Megatron's decoupled learning rate): they get a parameter group of their own that
    follows the same warm-up and decay from lr_warmup_init to this value and down to
    decoupled_min_lr. None: they follow lr like every other parameter."""

    decoupled_min_lr: float | None = None
    """The end of the decoupled learning rate's decay; None: min_lr. Needs decoupled_lr."""

    weight_decay: float = 0.01
    """Weight-decay coefficient (decoupled for adam and lion, L2 for sgd)."""

    apply_wd_to_qk_layernorm: bool = False
    """Decay the query and key norms' weights too (Megatron's --apply-wd-to-qk-layernorm,
    its no_weight_decay_cond_type "apply_wd_to_qk_layernorm"; Qwen3-Next's, whose
    zero-centred norms decay towards a scale of 1), which the default rule leaves undecayed
    with every other 1-D parameter."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum."""

    lion_beta1: float = 0.95
    """Lion's interpolation of the momentum and the gradient whose sign is the update."""

    lion_beta2: float = 0.98
    """Lion's momentum decay."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""

    torch_compile_optimizer: bool = False
    """Run AdamW's update compiled (torch.compile), one kernel per main parameter that
    also scales the gradient by the clipping coefficient and copies the result into the
    model's bf16 / fp16 parameter (mp_optim.compiled_step): one pass over the parameters
    and their state instead of three. Equal to torch's fused AdamW within fp32 rounding;
    the first step includes the compilation. Adam only."""

    log_num_zeros_in_grad: bool = False
    """Count the zero elements of the gradients at every step."""

    # Megatron's precision-aware optimizer (its OptimizerConfig's fields).

    use_precision_aware_optimizer: bool = False
    """Let the dtypes below differ from fp32 (Megatron's --use-precision-aware-optimizer,
    which needs the distributed optimizer or FSDP, and adam): Adam's moments stored in
    exp_avg_dtype and exp_avg_sq_dtype, updated in fp32 (low_precision_adam.py)."""

    exp_avg_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """Storage dtype of Adam's first moment; computed in fp32 every step. fp16 and fp8
    (Transformer Engine's scaled states) are refused."""

    exp_avg_sq_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    """Storage dtype of Adam's second moment (as exp_avg_dtype)."""

    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """dtype of the main parameters the optimizer updates: fp32 (fp16, Transformer Engine's
    FusedAdam with remainder bits, is refused)."""

    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype gradients are accumulated and reduced in: fp32, or bf16 (with bf16: the same
    as grad_reduce_in_bf16, which it sets, as Megatron's bf16 main gradients)."""

    # Mixed precision.

    fp16: bool = False
    """Model parameters in fp16, fp32 main parameters, dynamic loss scaling."""

    bf16: bool = False
    """Model parameters in bf16, fp32 main parameters."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the model's parameters (bf16 / fp16 runs set it to match)."""

    loss_scale: float | None = None
    """A constant loss scale for fp16; None: dynamic loss scaling."""

    initial_loss_scale: float = 2.0**32
    """Starting scale of dynamic loss scaling."""

    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""

    loss_scale_window: int = 1000
    """Clean steps (no inf/nan) after which the dynamic scale doubles."""

    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic scale is halved."""

    # Data-parallel gradients (Megatron's DistributedDataParallelConfig).

    use_distributed_optimizer: bool = False
    """Shard fp32 main parameters and optimizer states over data-parallel ranks (ZeRO-1)."""

    overlap_grad_reduce: bool = False
    """Start each bucket's reduction during the backward, as soon as its gradients are ready."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather each bucket's parameters just before the
    next forward uses them instead of right after the step."""

    bucket_size: int | None = None
    """Elements per gradient bucket; None: max(40M, 1M x dp) with overlap_grad_reduce,
    otherwise one bucket per dtype."""

    num_buckets: int | None = None
    """With overlap_grad_reduce, the gradient buckets' size is this rank's parameters /
    num_buckets instead (Megatron's --ddp-num-buckets; not with bucket_size; no effect
    without overlap_grad_reduce, as in Megatron, nor under FSDP, whose units are the
    layers)."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 whatever the parameters' dtype (implied by bf16)."""

    average_in_collective: bool = False
    """Average in the reduction (ReduceOp.AVG) instead of scaling by 1/dp before a sum."""

    calculate_per_token_loss: bool = False
    """Normalize the loss by the global batch's loss tokens (Megatron's
    --calculate-per-token-loss): each rank's loss stays a sum over its tokens, the gradients
    are summed (not averaged) over data-parallel ranks, and finalize divides them by the
    token count of the whole global batch. Otherwise each micro-batch's loss is its mean
    per token and the gradients are averaged over micro-batches and data-parallel ranks."""

    check_for_nan_in_grad: bool = False
    """Raise, naming the rank, when a gradient holds nan or inf before the reduction (under
    FSDP: after it, in this rank's gradient shards). Under mp-train's rerun_mode
    validate_results, each bucket's gradient norm is validated instead (DDP)."""

    check_for_large_grads: bool = False
    """Check each gradient bucket's norm before its reduction against 10 x the largest of
    the first 100 seen (Megatron's); a large one is run again and logged (mp-train's rerun
    engine), never fatal. DDP only: refused under FSDP."""

    # Sharded data parallelism (Megatron's --use-megatron-fsdp, --use-torch-fsdp2).

    use_megatron_fsdp: bool = False
    """Shard over the data-parallel ranks what data_parallel_sharding_strategy says (Megatron's
    --use-megatron-fsdp): no_shard is DDP, optim the distributed optimizer (ZeRO-1),
    optim_grads and optim_grads_params torch's FSDP2 per transformer layer (ZeRO-2, ZeRO-3;
    docs/fsdp.md). The strategy alone decides: use_distributed_optimizer is set from it."""

    data_parallel_sharding_strategy: Literal[
        "no_shard", "optim", "optim_grads", "optim_grads_params"
    ] = "optim_grads_params"
    """With use_megatron_fsdp, what is sharded over the data-parallel ranks: nothing
    (no_shard), the optimizer state (optim), also the gradients (optim_grads: each layer's
    parameters gathered at its forward and kept until its backward is over), also the
    parameters (optim_grads_params: gathered again in backward)."""

    use_torch_fsdp2: bool = False
    """ZeRO-3 on torch's FSDP2 (Megatron's --use-torch-fsdp2), with Megatron's refusals: no
    pipeline or expert parallelism, no distributed optimizer, no fp16, untied embeddings."""

    torch_fsdp2_reshard_after_forward: bool = True
    """With use_torch_fsdp2: free each layer's gathered parameters after its forward and
    gather them again in backward; False keeps them until the backward (ZeRO-2, Megatron's
    --torch-fsdp2-no-reshard-after-forward)."""

    grad_reduce_in_bf16: bool = False
    """With bf16: accumulate and reduce gradients in bf16 instead of fp32 (DDP's and the
    distributed optimizer's buffers, FSDP's reduce-scatter), as Megatron does; the fp32
    main parameters step from them. Half the gradient memory and traffic."""

    # The learning-rate and weight-decay schedule (OptimizerParamScheduler).

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the decay after warm-up."""

    lr_decay_iters: int | None = None
    """Iterations to decay over (iteration-based runs only); None: train_iters."""

    lr_decay_samples: int | None = None
    """Samples to decay over (sample-based runs only); None: train_samples."""

    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay steps; not with lr_warmup_iters/samples
    (Megatron-LM's rule)."""

    lr_warmup_iters: int = 0
    """Iterations of linear warm-up from lr_warmup_init to lr."""

    lr_warmup_samples: int = 0
    """Samples of linear warm-up (sample-based runs only)."""

    lr_warmup_init: float = 0.0
    """Learning rate at the start of warm-up."""

    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """Shape of the annealing phase of WSD."""

    lr_wsd_decay_iters: int | None = None
    """Iterations of WSD's annealing phase (the end of the decay)."""

    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's annealing phase (sample-based runs)."""

    start_weight_decay: float | None = None
    """Weight decay at step 0; None: weight_decay."""

    end_weight_decay: float | None = None
    """Weight decay at the end of training; None: weight_decay."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay goes from start_weight_decay to end_weight_decay (both needed
    unless constant, as in Megatron-LM)."""

    override_opt_param_scheduler: bool = False
    """Use this config's schedule, ignoring the one in a checkpoint."""

    use_checkpoint_opt_param_scheduler: bool = False
    """Use the schedule stored in a checkpoint, ignoring this config's."""

    def __post_init__(self) -> None:
        _choice("optimizer", self.optimizer, ("adam", "sgd", "muon", "lion"))
        _choice("lr_decay_style", self.lr_decay_style, _DECAY_STYLES)
        _choice("lr_wsd_decay_style", self.lr_wsd_decay_style, _WSD_STYLES)
        _choice("weight_decay_incr_style", self.weight_decay_incr_style, _WD_STYLES)
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True are exclusive: choose one")
        if self.torch_compile_optimizer and self.optimizer != "adam":
            raise ValueError(
                f"torch_compile_optimizer=True compiles AdamW's update; optimizer="
                f"{self.optimizer!r} has none: drop it or use adam"
            )
        if self.calculate_per_token_loss and self.average_in_collective:
            raise ValueError(
                "calculate_per_token_loss=True sums the gradients over data-parallel ranks; "
                "average_in_collective=True would average them: choose one"
            )
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"lr={self.lr} must be >= 0")
        if self.min_lr < 0:
            raise ValueError(f"min_lr={self.min_lr} must be >= 0")
        if self.lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} must be <= lr={self.lr}")
        self._check_decoupled_lr()
        for name in ("weight_decay", "clip_grad", "adam_eps", "sgd_momentum"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("adam_beta1", "adam_beta2", "lion_beta1", "lion_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale={self.loss_scale} must be > 0")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(
                f"initial_loss_scale={self.initial_loss_scale} and "
                f"min_loss_scale={self.min_loss_scale} must be > 0"
            )
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size={self.bucket_size} must be >= 1")
        if self.num_buckets is not None:
            if self.num_buckets < 1:
                raise ValueError(f"num_buckets={self.num_buckets} must be >= 1")
            if self.bucket_size is not None:
                raise ValueError(f"num_buckets={self.num_buckets} with bucket_size="
                                 f"{self.bucket_size}: give one (Megatron's rule)")  # fmt: skip
        self._check_sharding()
        if self.check_for_large_grads and self.fully_sharded:
            raise ValueError("check_for_large_grads checks DDP's gradient buckets, which FSDP "
                             "(ZeRO-2/3) does not have: drop it")  # fmt: skip
        self._check_precision_aware()
        self._check_muon()
        if self.overlap_param_gather and not (
            self.use_distributed_optimizer or self.use_megatron_fsdp
        ):
            raise ValueError(
                "overlap_param_gather=True needs use_distributed_optimizer=True or "
                "use_megatron_fsdp=True"
            )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction <= 1:
            raise ValueError(f"lr_warmup_fraction={self.lr_warmup_fraction} must be in [0, 1]")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "override_opt_param_scheduler=True and use_checkpoint_opt_param_scheduler=True "
                "are exclusive: choose one"
            )
        start, end = self.start_wd, self.end_wd
        if start < 0 or end < 0:
            raise ValueError(f"start_weight_decay={start} and end_weight_decay={end} must be >= 0")
        style = self.weight_decay_incr_style
        if style != "constant" and None in (self.start_weight_decay, self.end_weight_decay):
            raise ValueError(
                f"weight_decay_incr_style={style!r} needs start_weight_decay and "
                "end_weight_decay (as in Megatron-LM): without them the decay would stay at "
                "weight_decay"
            )
        if self.weight_decay_incr_style == "constant" and start != end:
            raise ValueError(
                f"weight_decay_incr_style='constant' needs start_weight_decay == "
                f"end_weight_decay, got {start} and {end}"
            )

    def _check_decoupled_lr(self) -> None:
        high, low = self.decoupled_lr, self.decoupled_min_lr
        if high is None:
            if low is not None:
                raise ValueError(f"decoupled_min_lr={low} needs decoupled_lr (the peak of "
                                 "that schedule): give both or drop it")  # fmt: skip
            return
        if high < 0:
            raise ValueError(f"decoupled_lr={high} must be >= 0")
        low = self.min_lr if low is None else low
        if low < 0:
            raise ValueError(f"decoupled_min_lr={low} must be >= 0")
        if low > high:
            name = "decoupled_min_lr" if self.decoupled_min_lr is not None else "min_lr"
            raise ValueError(f"{name}={low} (the end of the decoupled schedule) must be "
                             f"<= decoupled_lr={high}")  # fmt: skip
        if self.lr_warmup_init > high:
            raise ValueError(f"lr_warmup_init={self.lr_warmup_init} must be <= "
                             f"decoupled_lr={high}: both schedules warm up from it")  # fmt: skip

    def _check_precision_aware(self) -> None:
        """Megatron's rules for its precision-aware optimizer's dtypes."""
        dtypes = {
            "exp_avg_dtype": ("fp32", "bf16", "fp16", "fp8"),
            "exp_avg_sq_dtype": ("fp32", "bf16", "fp16", "fp8"),
            "main_params_dtype": ("fp32", "fp16"),
            "main_grads_dtype": ("fp32", "bf16"),
        }
        for name, choices in dtypes.items():
            _choice(name, getattr(self, name), choices)
        if not self.use_precision_aware_optimizer:
            for name in dtypes:
                if getattr(self, name) != "fp32":
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} needs "
                        "use_precision_aware_optimizer=True (as in Megatron)"
                    )
            return
        if self.optimizer != "adam":
            raise ValueError(f"use_precision_aware_optimizer=True with optimizer="
                             f"{self.optimizer!r}: adam only (as in Megatron)")  # fmt: skip
        if not (self.use_distributed_optimizer or self.fully_sharded):
            raise ValueError(
                "use_precision_aware_optimizer=True needs the distributed "
                "optimizer (use_distributed_optimizer) or FSDP, as in Megatron"
            )
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) in ("fp16", "fp8"):
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: moments in {getattr(self, name)} need "
                    "a scale per tensor (Transformer Engine's FusedAdam); mp stores them in "
                    "fp32 or bf16"
                )
        if self.main_params_dtype == "fp16":
            raise ValueError("main_params_dtype='fp16' needs Transformer Engine's FusedAdam "
                             "(fp16 main parameters with their remainder bits); mp keeps "
                             "fp32 main parameters")  # fmt: skip
        if self.main_grads_dtype == "bf16":
            if not self.bf16:
                raise ValueError("main_grads_dtype='bf16' needs bf16=True")
            if self.accumulate_allreduce_grads_in_fp32:
                raise ValueError("main_grads_dtype='bf16' and "
                                 "accumulate_allreduce_grads_in_fp32=True are exclusive (as "
                                 "in Megatron): choose one")  # fmt: skip
            self.grad_reduce_in_bf16 = True

    @property
    def moment_dtypes(self) -> dict[str, torch.dtype]:
        """Adam's moments' storage dtypes (exp_avg_dtype, exp_avg_sq_dtype)."""
        names = {"fp32": torch.float32, "bf16": torch.bfloat16}
        return {"exp_avg": names[self.exp_avg_dtype], "exp_avg_sq": names[self.exp_avg_sq_dtype]}

    def _check_sharding(self) -> None:
        """Megatron's rules for the FSDP flags; the strategy sets use_distributed_optimizer."""
        _choice("data_parallel_sharding_strategy", self.data_parallel_sharding_strategy,
                _SHARDING_STRATEGIES)  # fmt: skip
        if self.use_megatron_fsdp and self.use_torch_fsdp2:
            raise ValueError(
                "use_megatron_fsdp=True and use_torch_fsdp2=True are exclusive: choose one"
            )
        if self.use_torch_fsdp2:
            if self.use_distributed_optimizer:
                raise ValueError(
                    "use_torch_fsdp2=True with use_distributed_optimizer=True: FSDP2 shards "
                    "the optimizer state itself (Megatron refuses the pair too); drop "
                    "use_distributed_optimizer"
                )
            if self.fp16:
                raise ValueError("use_torch_fsdp2=True with fp16=True: not supported (as in "
                                 "Megatron); use bf16, or use_megatron_fsdp")  # fmt: skip
        if self.use_megatron_fsdp:
            # Megatron-FSDP implies the distributed optimizer; what it shards is the
            # strategy's: no_shard shards nothing, FSDP2 shards optim_grads(_params) itself.
            self.use_distributed_optimizer = self.data_parallel_sharding_strategy == "optim"
        if self.grad_reduce_in_bf16:
            if not self.bf16:
                raise ValueError("grad_reduce_in_bf16=True needs bf16=True")
            if self.accumulate_allreduce_grads_in_fp32:
                raise ValueError(
                    "grad_reduce_in_bf16=True and accumulate_allreduce_grads_in_fp32=True "
                    "are exclusive: choose one"
                )

    @property
    def fully_sharded(self) -> bool:
        """Gradients and parameters sharded by torch's FSDP2 (ZeRO-2 / ZeRO-3)."""
        return self.use_torch_fsdp2 or (
            self.use_megatron_fsdp
            and self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
        )

    @property
    def reshard_after_forward(self) -> bool:
        """Under FSDP: each layer's gathered parameters are freed after its forward (ZeRO-3)."""
        if self.use_torch_fsdp2:
            return self.torch_fsdp2_reshard_after_forward
        return self.fully_sharded and self.data_parallel_sharding_strategy == "optim_grads_params"

    @property
    def start_wd(self) -> float:
        """start_weight_decay, or weight_decay when unset."""
        return self.weight_decay if self.start_weight_decay is None else self.start_weight_decay

    @property
    def end_wd(self) -> float:
        """end_weight_decay, or weight_decay when unset."""
        return self.weight_decay if self.end_weight_decay is None else self.end_weight_decay

    @property
    def grad_reduce_in_fp32(self) -> bool:
        """Gradients accumulated and reduced in fp32: asked for, or implied by bf16 unless
        grad_reduce_in_bf16 (as in Megatron)."""
        implied = self.bf16 and not self.grad_reduce_in_bf16
        return self.accumulate_allreduce_grads_in_fp32 or implied

    @property
    def model_dtype(self) -> torch.dtype:
        """The model parameters' dtype implied by fp16 / bf16 (else params_dtype)."""
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return self.params_dtype


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(choices)}")
