"""mp-optim: Megatron's engine for gradients and optimizer state.

DistributedDataParallel (contiguous gradient buffers, bucketed and
overlapped reductions), the optimizer wrapper (fp32 / bf16 / fp16 with fp32
main parameters, loss scaling, global gradient clipping, the distributed
optimizer; Adam, SGD or Muon), FullyShardedDataParallel (ZeRO-2/3 on torch's FSDP2) and the
learning-rate / weight-decay schedule. Expert parameters
of mixture-of-experts layers (`param.expert_parallel = True`) are reduced,
sharded and normed over their own groups.
"""

from mp_optim.clip_grads import clip_grads_by_total_norm, count_zeros, get_grad_norm
from mp_optim.config import OptimizerConfig
from mp_optim.ddp import (
    DistributedDataParallel,
    InstanceGroups,
    broadcast_params,
    is_expert_parallel,
)
from mp_optim.factory import (
    default_no_weight_decay,
    get_optimizer,
    get_param_groups,
    is_embedding_or_output,
    is_vector_like,
)
from mp_optim.fsdp import FullyShardedDataParallel, LocalShard
from mp_optim.fsdp_sharding import FsdpSharding
from mp_optim.grad_buffer import Bucket, GradBuffer, ParamRange
from mp_optim.grad_norm_counting import counted_in_grad_norm
from mp_optim.grad_scaler import ConstantGradScaler, DynamicGradScaler
from mp_optim.muon import MatrixLayout, Muon, newton_schulz
from mp_optim.optimizer import MainParamShard, MixedPrecisionOptimizer, StepResult
from mp_optim.param_scaling import scale_rows
from mp_optim.scheduler import OptimizerParamScheduler, get_optimizer_param_scheduler

__all__ = [
    "Bucket",
    "ConstantGradScaler",
    "DistributedDataParallel",
    "DynamicGradScaler",
    "FsdpSharding",
    "FullyShardedDataParallel",
    "GradBuffer",
    "InstanceGroups",
    "LocalShard",
    "MainParamShard",
    "MatrixLayout",
    "MixedPrecisionOptimizer",
    "Muon",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "ParamRange",
    "StepResult",
    "broadcast_params",
    "clip_grads_by_total_norm",
    "count_zeros",
    "counted_in_grad_norm",
    "default_no_weight_decay",
    "get_grad_norm",
    "get_optimizer",
    "get_optimizer_param_scheduler",
    "get_param_groups",
    "is_embedding_or_output",
    "is_expert_parallel",
    "is_vector_like",
    "newton_schulz",
    "scale_rows",
]
