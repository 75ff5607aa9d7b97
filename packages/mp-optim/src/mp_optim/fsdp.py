"""FullyShardedDataParallel: ZeRO-2 and ZeRO-3 on torch's FSDP2, over mp's own groups.

    model = FullyShardedDataParallel(config, chunk, dp_group=state.dp_cp,
                                     expert_dp_group=state.expert_dp, units=(TransformerLayer,))
    optimizer = get_optimizer(config, [model], mp_group=state.mp)
    ...  # the loop of ddp.py: no_sync, finish_grad_sync, optimizer.step(), zero_grad()

torch's `fully_shard` is applied, bottom-up, to
1. each module holding only routed experts' parameters (`expert_parallel = True`,
   e.g. a MoE layer's grouped experts), over a mesh made from `expert_dp_group`;
2. each module of a `units` type (the transformer layers), over `dp_group`;
3. the chunk itself (the embeddings, the final norm, the output layer), over `dp_group`.
The tensors sharded are the ones the tensor-parallel layers already hold on this rank
(FSDP2 sees plain tensors and splits their first dimension over the data-parallel
ranks), so tensor, sequence, context and pipeline parallelism compose unchanged.

Between steps every parameter is a DTensor holding this rank's rows (its *shard*).
Before a unit's forward FSDP2 all-gathers its parameters; with reshard_after_forward
(ZeRO-3, `optim_grads_params`) it frees them after the forward and gathers them again
in backward; without (ZeRO-2, `optim_grads`) it keeps them until the unit's backward
is over. After the backward of the last micro-batch each unit's gradients are
reduce-scattered, leaving each rank the reduced gradient of its shard; on the other
micro-batches (no_sync) they accumulate unreduced, so a global batch costs one
reduction, as with DDP.

Reduction: gradients end as the mean over dp_group, expert ones too (ddp.py says why
experts divide by dp, not by their own group's size): summed by the collective, then
divided by dp (average_in_collective: ReduceOp.AVG where dp is the group's size); with
calculate_per_token_loss they end as the sum, which finalize divides by the tokens.
Experts sharded over a group of one rank (expert dp 1) are divided by dp in
finish_grad_sync instead (FSDP2 divides twice there).
Accumulation and reduction run in the dtype DDP would use (fp32 with bf16), in bf16
with grad_reduce_in_bf16.

Mixed precision: the shards stay fp32 (a bf16 / fp16 model's parameters are made fp32
before sharding); FSDP2 casts them to the model's dtype for the all-gather and the
compute (MixedPrecisionPolicy). The optimizer steps the fp32 shards in place (they are
the main parameters) from the gradient shards, which persist between steps like DDP's
buffers (zero_grad_buffer zeros them) and are each parameter's `.main_grad`, so the
pipeline's finalize reduces sequence-parallel and tied-embedding gradients shard-wise.

The Python attributes mp puts on parameters (sequence_parallel, shared_embedding,
expert_parallel, ...) are copied onto the sharded parameters, which fully_shard
creates anew.

Sharding itself is FsdpSharding's (fsdp_sharding.py), which can also shard each
transformer layer as soon as it is built (mp_layers.on_layer_built), so that no rank
holds a whole chunk.

Checkpoints: sharded_state_dict() describes each rank's shards as flattened ranges of
the logical tensors (computed on meta stand-ins of the whole parameters, piece_layout),
so mp's sharded checkpoints load across FSDP, DDP and the distributed optimizer at any
layout; restore_pieces() writes loaded values back into the shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mp_ckpt import ShardedTensor
from mp_optim.config import OptimizerConfig
from mp_optim.ddp import ChunkWrapper, InstanceGroups, is_expert_parallel
from mp_optim.flat_ranges import Overlap, flat_range_piece, overlap
from mp_optim.fsdp_sharding import FsdpSharding, is_dtensor, is_sharded
from mp_optim.grad_norm_counting import counted_of
from mp_state import RankGroup

__all__ = ["FullyShardedDataParallel", "LocalShard"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalShard:
    """This rank's rows of one FSDP-sharded parameter."""

    name: str
    param: torch.nn.Parameter
    """The sharded parameter (a DTensor)."""
    data: torch.Tensor
    """Its local rows (fp32): the main parameter the optimizer steps in place."""
    grad: torch.Tensor
    """The reduced gradient of those rows (persistent; `param.main_grad`)."""
    start: int
    """Where `data` starts in the flattened whole parameter."""
    counted: bool
    """Counted in the gradient norm (not a replica)."""
    expert_parallel: bool
    dtype: torch.dtype
    """The model's dtype for the parameter (its checkpoint pieces are saved in it)."""


class FullyShardedDataParallel(ChunkWrapper):
    """Wraps `module`, sharding its parameters, gradients and optimizer state over
    `dp_group` with torch's FSDP2 (see the module docstring).

    Arguments:
        config: the OptimizerConfig; config.fully_sharded must be true.
        module: the model chunk (parameters on the run's device).
        dp_group: the group gradients are averaged over and dense parameters sharded over
            (`state.dp_cp`).
        expert_dp_group: the group expert parameters are sharded over (`state.expert_dp`);
            needed when the module has parameters marked `expert_parallel = True`.
        units: module types each gathered and freed as one (the transformer layer).
        instances, expert_instances: distributed-optimizer instances (ddp.InstanceGroups):
            hybrid sharding, each parameter sharded over the rank's slice of its group
            and replicated across the slices (FSDP2's HSDP); None for none.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        module: torch.nn.Module,
        *,
        dp_group: RankGroup,
        expert_dp_group: RankGroup | None = None,
        units: tuple[type[torch.nn.Module], ...] = (),
        sharding: FsdpSharding | None = None,
        instances: InstanceGroups | None = None,
        expert_instances: InstanceGroups | None = None,
    ) -> None:
        super().__init__()
        # FSDP2 warns when a root returns a view (GPTModel's [b, s] loss at b = 1): its
        # pre-backward hook would be lost by an in-place op on the output, which mp's
        # schedules and loss functions never make.
        warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
        self.config = config
        self.module = module
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self._instances = {False: instances, True: expert_instances}
        if sharding is None:
            sharding = FsdpSharding(config, dp_group, expert_dp_group, instances,
                                    expert_instances)  # fmt: skip
        elif (sharding.instances, sharding.expert_instances) != (instances, expert_instances):
            raise ValueError("the FsdpSharding and the wrapper were given other instances")
        self.unit_modules = [
            m for m in module.modules() if isinstance(m, units) and m is not module
        ]
        for unit in self.unit_modules:
            if not is_sharded(unit):  # units sharded while the chunk was built stay so
                sharding.shard(unit)
        sharding.shard(module, root=True)
        sharding.restore_attributes(module)
        if config.overlap_param_gather:
            # Each unit's forward starts the next one's all-gather.
            for unit, following in itertools.pairwise(self.unit_modules):
                unit.set_modules_to_forward_prefetch([following])
            if sharding.device_type == "cpu":
                _gather_asynchronously(module)
        divided_here = [m for m in self._fsdp_modules() if self._set_reduction(m)]

        counted = self._counted()
        self.shards: list[LocalShard] = []
        self._grads: list[torch.Tensor] = []  # the DTensors over the persistent shards
        with torch.no_grad():
            for name, param in module.named_parameters():
                if not param.requires_grad:
                    continue
                param.grad = torch.zeros_like(param)  # FSDP2 accumulates into it
                self._grads.append(param.grad)
                local = param.to_local()
                param.main_grad = param.grad.to_local()
                self.shards.append(LocalShard(
                    name, param, local, param.main_grad,
                    _flat_start(param, self.shard_group(is_expert_parallel(param))),
                    param in counted, is_expert_parallel(param),
                    getattr(param, "unsharded_dtype", param.dtype),
                ))  # fmt: skip
        self._shard_of = {id(s.param): s for s in self.shards}
        self._divided_here = [self._shard_of[id(p)] for m in divided_here
                              for p in _own_parameters(m) if id(p) in self._shard_of]  # fmt: skip
        """Shards over a group of one: finish_grad_sync divides their gradients by dp."""

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            # No backward follows to free what the forward gathered (evaluation): the
            # root, and with ZeRO-2 every unit, would stay whole, their parameters plain
            # tensors the optimizer and the checkpoint do not know.
            self.reshard()
        return output

    def reshard(self) -> None:
        """Shards every gathered parameter again, as between steps (FSDP2's reshard of
        each sharded module; nothing where all are sharded)."""
        for sharded in self._fsdp_modules():
            sharded.reshard()

    # --- the training loop's calls (as DistributedDataParallel's) ---------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate unreduced (all but the last micro-batch of a global batch)."""
        self.module.set_requires_gradient_sync(False)
        self.module.set_is_last_backward(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            self.module.set_is_last_backward(True)

    def start_grad_sync(self) -> None:
        """Nothing to start: each unit's reduce-scatter starts in its post-backward."""

    def finish_grad_sync(self) -> None:
        """After the last backward: every parameter sharded again, its reduced gradient
        in its shard's `.main_grad`."""
        self.reshard()
        with torch.no_grad():
            for shard, persistent in zip(self.shards, self._grads, strict=True):
                grad = shard.param.grad
                if grad is persistent:
                    continue
                # Someone set .grad to None (FSDP2 then made a new one): back to the
                # persistent shard, which the optimizer reads.
                if grad is None:
                    shard.grad.zero_()
                else:
                    shard.grad.copy_(grad.to_local())
                shard.param.grad = persistent
            for shard in self._divided_here:
                shard.grad.div_(self.dp_group.size)
        if self.config.check_for_nan_in_grad:
            bad = [s.name for s in self.shards if not torch.isfinite(s.grad).all()]
            if bad:
                raise RuntimeError(
                    f"rank {self.dp_group.global_rank}: non-finite gradient after the "
                    f"data-parallel reduce-scatter in {', '.join(bad)}"
                )

    def zero_grad_buffer(self) -> None:
        """Zeros the gradient shards before a new global batch."""
        for shard in self.shards:
            shard.grad.zero_()

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """Nothing to gather after the step: each unit gathers its shards at its forward."""

    def finish_param_sync(self) -> None:
        """Nothing to wait for (see start_param_sync)."""

    # --- checkpoints ---------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        """The module's pieces cut to this rank's shards: each piece of a parameter becomes
        the flattened range of its box that this rank's rows hold (see flat_ranges.py), in
        the model's dtype (a copy where that is not fp32 or the range is not contiguous in
        the shard: restore_pieces writes loaded values back). Shards of different
        data-parallel ranks are disjoint, so none is a replica (but for the other
        distributed-optimizer instances' copies). Buffers' pieces are the module's own."""
        pieces = {}
        for key, piece, param, offset in self.piece_layout(prefix):
            if param is None:
                pieces[key] = piece
                continue
            cut = self._cut(piece, param, offset)
            if cut is not None:
                shard, part = cut
                copies = self.replica_group(shard.expert_parallel)  # the other slices'
                if copies is not None:
                    piece = dataclasses.replace(
                        piece, replica_id=piece.replica_id * copies.size + copies.rank
                    )
                pieces[key], _ = flat_range_piece(key, piece, part, shard.data, shard.dtype)
        return pieces

    def restore_pieces(self, pieces: dict[str, ShardedTensor]) -> None:
        """Writes sharded_state_dict()'s pieces, filled by a checkpoint load, into the
        shards."""
        with torch.no_grad():
            for key, piece, param, offset in self.piece_layout():
                cut = self._cut(piece, param, offset) if param is not None else None
                if cut is not None and key in pieces:
                    shard, part = cut
                    flat = shard.data.view(-1)
                    flat[part.positions] = pieces[key].data.to(flat.dtype)

    def piece_layout(self, prefix: str = ""):
        """(key, piece, parameter, offset) for every piece of the module's
        sharded_state_dict as the whole (unsharded) parameters give it: the piece's data
        is a view of a meta tensor standing in for `parameter` (the sharded one), starting
        at element `offset` of it; for a buffer's piece, parameter is None. Gathered
        parameters are sharded again first (reshard)."""
        self.reshard()
        stand_ins: dict[int, torch.nn.Parameter] = {}
        swapped = []
        for module in self.module.modules():
            for name, param in module._parameters.items():
                if not is_dtensor(param):
                    continue
                if id(param) not in stand_ins:
                    meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
                    stand_ins[id(param)] = torch.nn.Parameter(meta, param.requires_grad)
                swapped.append((module, name, param))
        owners = {}
        try:
            for module, name, param in swapped:
                module._parameters[name] = stand_in = stand_ins[id(param)]
                owners[stand_in.untyped_storage()._cdata] = param
            with torch.no_grad():
                pieces = self.module.sharded_state_dict(prefix)
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param
        for key, piece in pieces.items():
            param = owners.get(piece.data.untyped_storage()._cdata)
            offset = piece.data.storage_offset() if param is not None else 0
            yield key, piece, param, offset

    def state_dict(self, *args, **kwargs):
        raise NotImplementedError(_WHOLE_STATE)

    def load_state_dict(self, *args, **kwargs):
        raise NotImplementedError(_WHOLE_STATE)

    # --- internals -------------------------------------------------------------------------

    def shard_group(self, expert: bool) -> RankGroup:
        """The group expert (or dense) parameters are sharded over: expert dp (dp), or with
        distributed-optimizer instances this rank's slice of it."""
        instances = self._instances[expert]
        if instances is not None:
            return instances.intra
        return self.expert_dp_group if expert else self.dp_group

    def replica_group(self, expert: bool) -> RankGroup | None:
        """With distributed-optimizer instances, the ranks holding this rank's shards of
        expert (or dense) parameters in the other slices; else None."""
        instances = self._instances[expert]
        return instances.inter if instances else None

    def _counted(self) -> set[torch.nn.Parameter]:
        """The parameters counted in the gradient norm (grad_norm_counting.counted_of's rule over
        the pieces of the whole parameters)."""
        located = ((piece, param, offset) for _, piece, param, offset in self.piece_layout()
                   if param is not None)  # fmt: skip
        return counted_of(located, list(self.module.parameters()))

    def _cut(self, piece: ShardedTensor, param, offset: int) -> tuple[LocalShard, Overlap] | None:
        """The shard of `param` and the part of `piece` (a view of it at `offset`) in it."""
        shard = self._shard_of[id(param)]
        if not shard.data.numel():
            return None
        part = overlap(piece, param.numel(), offset, shard.start, shard.start + shard.data.numel())
        return None if part is None else (shard, part)

    def _fsdp_modules(self) -> list[torch.nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def _set_reduction(self, sharded) -> bool:
        """Every gradient ends as the mean over dp_group (the sum with a per-token loss);
        True where finish_grad_sync divides (a group of one)."""
        params = list(sharded.parameters())
        expert = bool(params) and all(is_expert_parallel(p) for p in params)
        group = self.shard_group(expert)  # the reduce-scatter's (then, HSDP, an all-reduce)
        config = self.config
        divisor = 1.0 if config.calculate_per_token_loss else float(self.dp_group.size)
        # A group of one (each expert on one rank: expert dp 1) has nothing to reduce, and
        # there FSDP2 (torch 2.15's foreach_reduce) divides a sum-forced reduction twice,
        # by divisor squared: it divides by nothing, finish_grad_sync by dp.
        divided_later = group.size == 1 and divisor != 1.0
        if divided_later:
            divisor = 1.0
        sharded.set_gradient_divide_factor(divisor)
        # ReduceOp.AVG divides by the group's size only; another divisor (an expert group
        # smaller than dp) is a sum, then a division, on every backend.
        averaged = (config.average_in_collective and divisor == group.size
                    and self._instances[expert] is None)  # fmt: skip
        sharded.set_force_sum_reduction_for_comms(not averaged)
        # A parameter without a gradient on this rank joins the reduction with zeros, so
        # every rank issues the same collectives (as DDP's buffers reduce every parameter).
        # Older torch (2.11) lacks the switch: mp's layers give every parameter a gradient.
        if hasattr(sharded, "set_reduce_scatter_unused_params"):
            sharded.set_reduce_scatter_unused_params(True, recurse=False)
        return divided_later


_WHOLE_STATE = (
    "a torch state_dict of FSDP-sharded parameters would gather the whole model on every "
    "rank: use sharded_state_dict() (mp's sharded checkpoint; mp_train's save and load)"
)

_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def _own_parameters(sharded: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters `sharded` (an FSDP2 module) reduces itself: its own, not those of
    the sharded modules inside it (a chunk's embedding and output layer, not its layers')."""
    from torch.distributed.fsdp import FSDPModule

    inner = {id(p) for m in sharded.modules() if m is not sharded and isinstance(m, FSDPModule)
             for p in m.parameters()}  # fmt: skip
    return [p for p in sharded.parameters() if id(p) not in inner]


def _flat_start(param, group: RankGroup) -> int:
    """Where this rank's rows start in the flattened whole parameter (FSDP2 gives rank r
    of the group the parameter is sharded over rows [r c, (r + 1) c) of the first
    dimension, c = ceil(rows / ranks)). The rank is mp's group's, not read back from the
    parameter's DeviceMesh, which resolves its group by a registered name."""
    rows = param.shape[0] if param.dim() else 1
    per_rank = -(-rows // group.size)
    first = min(group.rank * per_rank, rows)
    return first * (param.numel() // max(rows, 1))


def _gather_asynchronously(module: torch.nn.Module) -> None:
    """On the CPU, FSDP2's all-gathers before a forward or backward are issued
    asynchronously (async_op=True, waited for where the unit needs them), so that a
    prefetched all-gather runs on gloo's thread while this unit computes; otherwise
    FSDP2 waits for each where it issues it, as a GPU's stream needs no more
    (docs/fsdp.md, Overlap). Through FSDP2's `_set_unshard_async_op`, torch's private
    name for it; without it the run says so and gathers synchronously."""
    setter = getattr(module, "_set_unshard_async_op", None)
    if setter is None:
        log.warning(
            "--overlap-param-gather on the CPU: this torch's FSDP2 has no "
            "_set_unshard_async_op; each all-gather is waited for where it is issued"
        )
        return
    setter(True)
