"""DistributedDataParallel: gradient buffers, bucketed reductions, parameter gathers.

    model = DistributedDataParallel(config, model, dp_group=state.dp_cp)
    model.zero_grad_buffer()
    for i, batch in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
            (loss(model(batch)) / len(micro_batches)).backward()
    model.finish_grad_sync()     # every gradient now averaged over dp
    optimizer.step()             # (the distributed optimizer also gathers the parameters)

The backward adds each parameter's gradient into its `.main_grad`, a view
into the contiguous buffers of grad_buffer.py, and drops `.grad`. The first
gradient of a parameter after zero_grad_buffer() is copied rather than added
(the same values: the buffer is zero): converting a bf16 gradient into an
fp32 buffer is a copy at memory speed, where add_ first makes an fp32
temporary of the whole gradient. On the last
micro-batch (outside no_sync) each bucket is reduced as one collective: an
all-reduce, or with the distributed optimizer a reduce-scatter that leaves
each rank the sum of its own shard. With overlap_grad_reduce a bucket's
collective starts during the backward as soon as its last gradient arrives
(buckets are started in order, so every rank issues the same sequence of
collectives); finish_grad_sync() waits for them. Without it, finish_grad_sync
starts them all after the backward.

Gradients are averaged over the data-parallel group: scaled by 1/dp before a
sum, or with average_in_collective by the collective itself (ReduceOp.AVG).
With calculate_per_token_loss they are summed (each rank's loss is a sum over
its tokens) and finalize divides them by the global batch's token count.
After the distributed optimizer's step, start_param_sync() all-gathers every
bucket's parameters; with overlap_param_gather it returns at once and each
module waits for its own parameters in a forward pre-hook.

Expert parameters (`param.expert_parallel = True`: the routed experts of a
mixture-of-experts layer, split over the expert-parallel ranks) have buffers
of their own, reduced (and, for the distributed optimizer, sharded and
gathered) over `expert_dp_group`, which with expert parallelism is smaller
than the dense dp_cp group: the expert layers re-divide each stage's
tp x cp x dp ranks as expert tp x ep x expert dp. Their result is still the
mean over all dp ranks, as for dense gradients: the all-to-all brings each
expert the tokens of every micro-batch of its ep group, so its local
gradient already sums ep ranks' losses, and the sum over expert_dp then
covers every data-parallel rank once. The factor is therefore 1/dp for
both kinds; with average_in_collective an expert bucket is first multiplied
by expert_dp/dp and then averaged over expert_dp. Dense and expert buckets
are started in two independent sequences, each in the same order on every
rank of its group.

With several distributed-optimizer instances (Megatron's
--num-distributed-optimizer-instances; `InstanceGroups`, from mp-state's intra_* and
inter_* groups) a bucket is reduce-scattered over the rank's slice of its data-parallel
group only ("intra"), then each shard is all-reduced over the ranks holding the same shard
in the other slices ("inter"): the same sum in a different order. The optimizer shards
over the slice, and the parameters are gathered within it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from mp_optim.config import OptimizerConfig
from mp_optim.grad_buffer import Bucket, GradBuffer
from mp_state import RankGroup

__all__ = ["DistributedDataParallel", "InstanceGroups", "broadcast_params", "is_expert_parallel"]

_DEFAULT_OVERLAP_BUCKET = 40_000_000


class ChunkWrapper(torch.nn.Module):
    """What a data-parallel wrapper of a model chunk forwards to the chunk itself."""

    module: torch.nn.Module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Passes a pipeline stage's input to the wrapped module."""
        self.module.set_input_tensor(tensor)

    def restore_pieces(self, pieces: dict) -> None:
        """After a checkpoint load filled sharded_state_dict()'s pieces: puts values held
        in copies back into the model. Nothing to do here: every piece is a view of a
        parameter (FSDP's are not)."""


class InstanceGroups(NamedTuple):
    """A data-parallel group cut into distributed-optimizer instances: this rank's slice
    (`intra`, the ranks its optimizer shards over) and the ranks holding its shard in the
    other slices (`inter`); mp-state's intra_dp_cp and inter_dp_cp (or intra_expert_dp and
    inter_expert_dp)."""

    intra: RankGroup
    inter: RankGroup


class DistributedDataParallel(ChunkWrapper):
    """Wraps `module`; its parameters' gradients go to buffers reduced over `dp_group`.

    Arguments:
        config: the OptimizerConfig (use_distributed_optimizer, overlap_grad_reduce,
            overlap_param_gather, bucket_size, accumulate_allreduce_grads_in_fp32 /
            bf16, average_in_collective, check_for_nan_in_grad).
        module: the model chunk; its parameters must not change afterwards.
        dp_group: the group gradients are averaged over (`state.dp_cp`, or
            `state.dp` without context parallelism).
        expert_dp_group: the group that reduces expert parameters' gradients
            (`state.expert_dp`); needed only when the module has parameters
            marked `expert_parallel = True`.
        instances, expert_instances: with the distributed optimizer, dp_group's and
            expert_dp_group's distributed-optimizer instances (module docstring), or
            None for one instance.
    """

    def __init__(
        self,
        config: OptimizerConfig,
        module: torch.nn.Module,
        *,
        dp_group: RankGroup,
        expert_dp_group: RankGroup | None = None,
        instances: InstanceGroups | None = None,
        expert_instances: InstanceGroups | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.module = module
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self._instances = {False: instances, True: expert_instances}
        if (instances or expert_instances) and not config.use_distributed_optimizer:
            raise ValueError("distributed-optimizer instances need use_distributed_optimizer")
        bucket_size = config.bucket_size
        if bucket_size is None and config.overlap_grad_reduce:
            bucket_size = max(_DEFAULT_OVERLAP_BUCKET, 1_000_000 * dp_group.size)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {p: n for n, p in named}
        params = [p for _, p in named]
        experts = [n for n, p in named if is_expert_parallel(p)]
        if experts and expert_dp_group is None:
            raise ValueError(
                f"{experts[0]} is an expert-parallel parameter (expert_parallel=True), but "
                "DistributedDataParallel got no expert_dp_group to reduce its gradient over: "
                "pass expert_dp_group=state.expert_dp"
            )
        by_kind: dict[tuple[bool, torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in reversed(params):  # about the order the backward produces them
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            key = (is_expert_parallel(param), param.dtype, grad_dtype)
            by_kind.setdefault(key, []).append(param)
        shard = config.use_distributed_optimizer
        self.buffers = [
            GradBuffer(members, grad_dtype, bucket_size=bucket_size, shard_for_dp=shard,
                       dp_size=self.shard_group(expert).size, expert_parallel=expert)
            for (expert, _, grad_dtype), members in by_kind.items()
        ]  # fmt: skip
        self.buckets: list[Bucket] = [b for buffer in self.buffers for b in buffer.buckets]
        self._bucket_of = {p: b for buffer in self.buffers for p, b in buffer.bucket_of.items()}
        # One launch sequence (lane) per reducing group: dense buckets, then expert ones.
        kinds = sorted({b.buffer.expert_parallel for b in self.buckets})
        self._lanes = [[b for b in self.buckets if b.buffer.expert_parallel == k] for k in kinds]
        self._lane_of = {b: i for i, lane in enumerate(self._lanes) for b in lane}

        self._bucket_index = {b: i for i, b in enumerate(self.buckets)}
        self.grad_observer: Callable[[int, torch.Tensor], None] | None = None
        """Called with (the bucket's index, its local gradient) before each bucket's
        reduction (mp-train's rerun engine validates their norms)."""
        self.raise_on_nonfinite = config.check_for_nan_in_grad
        """check_for_nan_in_grad's raise, unless an observer validates the gradients."""

        self._sync_enabled = True
        self._empty: set[torch.nn.Parameter] = set(params)  # .main_grad still all zero
        self._ready: dict[Bucket, set[torch.nn.Parameter]] = {}
        self._next_launch = [0] * len(self._lanes)
        self._grad_work: dict[Bucket, tuple[dist.Work | None, torch.Tensor | None]] = {}
        self._param_work: dict[Bucket, dist.Work] = {}
        # The hooks reach this wrapper through a weak reference: torch does not show a
        # tensor's hooks to Python's garbage collector, so a hook holding the wrapper (a
        # bound method) kept the model and its buffers alive after the last reference.
        on_grad = _weakly(self, DistributedDataParallel._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params]
        if config.overlap_param_gather:
            for sub in module.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    self._hooks.append(sub.register_forward_pre_hook(self._wait_params_of))

    def reduce_group(self, bucket: Bucket) -> RankGroup:
        """The group that reduces `bucket` (and shards it, for the distributed optimizer):
        expert_dp_group for expert-parallel buckets, else dp_group; with several
        distributed-optimizer instances, this rank's slice of it."""
        return self.shard_group(bucket.buffer.expert_parallel)

    def shard_group(self, expert: bool) -> RankGroup:
        """The group the distributed optimizer shards expert (or dense) parameters over:
        expert_dp_group (dp_group), or with several instances this rank's slice of it."""
        instances = self._instances[expert]
        return instances.intra if instances else self._group_of(expert)

    def replica_group(self, expert: bool) -> RankGroup | None:
        """With several distributed-optimizer instances, the ranks holding this rank's
        optimizer shard of expert (or dense) parameters in the other instances; else None."""
        instances = self._instances[expert]
        return instances.inter if instances else None

    # --- the training loop's calls -------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate in the buffers without being reduced (all but the last
        micro-batch of a global batch)."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def start_grad_sync(self) -> None:
        """Starts the reduction of every bucket not yet started."""
        for lane, bucket_list in enumerate(self._lanes):
            while self._next_launch[lane] < len(bucket_list):
                self._launch(bucket_list[self._next_launch[lane]])
                self._next_launch[lane] += 1

    def finish_grad_sync(self) -> None:
        """Waits until every bucket is reduced (starting those not yet started)."""
        self.start_grad_sync()
        across = []  # the sums across distributed-optimizer instances
        # lane by lane, each in launch order: every rank of an inter group issues the same
        for bucket in (b for lane in self._lanes for b in lane if b in self._grad_work):
            work, received = self._grad_work[bucket]
            if work is not None:
                work.wait()
            inter = self.replica_group(bucket.buffer.expert_parallel)
            if received is not None and inter is not None and inter.size > 1:
                op = dist.ReduceOp.AVG if self._averages(bucket) else dist.ReduceOp.SUM
                across.append(dist.all_reduce(received, op=op, group=inter.group, async_op=True))
        for work in across:
            work.wait()
        for bucket, (_, received) in self._grad_work.items():
            if received is not None:
                group = self.reduce_group(bucket)
                shard = bucket.shard(group.rank, group.size)
                bucket.buffer.grad_data[shard.start : shard.end].copy_(received)
        self._grad_work.clear()
        self._ready.clear()
        self._next_launch = [0] * len(self._lanes)

    def zero_grad_buffer(self) -> None:
        """Zeros the gradient buffers before a new global batch."""
        for buffer in self.buffers:
            buffer.reset()
        for param in self._bucket_of:
            param.grad = None
        self._empty = set(self._bucket_of)
        self._ready.clear()
        self._next_launch = [0] * len(self._lanes)
        self._grad_work.clear()

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """All-gathers every bucket's parameters from the ranks owning their shards.

        For the distributed optimizer, after its step. With overlap_param_gather
        (and not force_sync) the gathers run in the background and each module
        waits for its parameters when its forward starts.
        """
        if not self.config.use_distributed_optimizer:
            return
        self.finish_param_sync()
        for bucket in reversed(self.buckets):  # the forward needs the last buckets first
            group = self.reduce_group(bucket)
            if group.size == 1:
                continue
            shard = bucket.shard(group.rank, group.size)
            mine = bucket.buffer.param_data[shard.start : shard.end].clone()
            self._param_work[bucket] = dist.all_gather_into_tensor(
                bucket.param_data, mine, group=group.group, async_op=True
            )
        if force_sync or not self.config.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Waits for every parameter gather still running."""
        for work in self._param_work.values():
            work.wait()
        self._param_work.clear()

    def broadcast_params(self) -> None:
        """Copies data-parallel rank 0's parameters to the other ranks (after a
        data-parallel random initialization); expert parameters go from expert
        data-parallel rank 0 over expert_dp_group."""
        broadcast_params(self.module, self.dp_group, self.expert_dp_group)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(*args, **kwargs)

    def sharded_state_dict(self, prefix: str = ""):
        """The wrapped module's sharded_state_dict (after any parameter gather finishes)."""
        self.finish_param_sync()
        return self.module.sharded_state_dict(prefix)

    # --- internals -------------------------------------------------------------------------

    def _group_of(self, expert: bool) -> RankGroup:
        return self.expert_dp_group if expert else self.dp_group

    def _averages(self, bucket: Bucket) -> bool:
        """Whether `bucket`'s collectives average (average_in_collective) or sum."""
        return (
            self.config.average_in_collective
            and self._group_of(bucket.buffer.expert_parallel).size > 1
        )

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """After the backward accumulated param.grad: move it into the buffer."""
        if param in self._empty:
            param.main_grad.copy_(param.grad)
            self._empty.discard(param)
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        if self.config.overlap_grad_reduce and self._sync_enabled:
            bucket = self._bucket_of[param]
            self._ready.setdefault(bucket, set()).add(param)
            # Each lane starts its buckets in order, so every rank of its group issues
            # the same collectives.
            lane = self._lane_of[bucket]
            bucket_list = self._lanes[lane]
            while self._next_launch[lane] < len(bucket_list):
                head = bucket_list[self._next_launch[lane]]
                if len(self._ready.get(head, ())) != len(head.params):
                    break
                self._launch(head)
                self._next_launch[lane] += 1

    def _launch(self, bucket: Bucket) -> None:
        grad = bucket.grad_data
        group = self.reduce_group(bucket)
        # The reduction writes the whole bucket: a parameter that had no gradient here
        # may hold other ranks' from now on, so only a zero_grad_buffer() empties it again.
        self._empty.difference_update(bucket.params)
        if self.grad_observer is not None:
            self.grad_observer(self._bucket_index[bucket], grad)
        if self.raise_on_nonfinite and not torch.isfinite(grad).all():
            names = [self._names[p] for p in bucket.params if not p.main_grad.isfinite().all()]
            raise RuntimeError(
                f"rank {group.global_rank}: non-finite gradient before the data-parallel "
                f"reduction over {group.kind} in {', '.join(names)}"
            )
        # Both kinds end as the mean over dp_group (the module docstring says why experts
        # too): 1/dp before a sum, or group/dp before an average over the group (over the
        # slice, then across the instances: the same mean). With a per-token loss they end
        # as the sum, which finalize divides by the batch's tokens.
        whole = self._group_of(bucket.buffer.expert_parallel)
        average = self._averages(bucket)
        if self.config.calculate_per_token_loss:
            scale = 1.0
        elif average:
            scale = whole.size / self.dp_group.size
        else:
            scale = 1.0 / self.dp_group.size
        if scale != 1.0:
            grad.mul_(scale)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        if group.size == 1:
            inter = self.replica_group(bucket.buffer.expert_parallel)
            if inter is not None and inter.size > 1:  # a slice of one rank: only across
                work = dist.all_reduce(grad, op=op, group=inter.group, async_op=True)
                self._grad_work[bucket] = (work, None)
            else:
                self._grad_work[bucket] = (None, None)
            return
        if self.config.use_distributed_optimizer:
            received = torch.empty(bucket.numel // group.size, dtype=grad.dtype, device=grad.device)
            work = dist.reduce_scatter_tensor(
                received, grad, op=op, group=group.group, async_op=True
            )
            self._grad_work[bucket] = (work, received)
        else:
            work = dist.all_reduce(grad, op=op, group=group.group, async_op=True)
            self._grad_work[bucket] = (work, None)

    def _wait_params_of(self, module: torch.nn.Module, args) -> None:
        if not self._param_work:
            return
        for param in module.parameters(recurse=False):
            bucket = self._bucket_of.get(param)
            if bucket is not None and bucket in self._param_work:
                self._param_work.pop(bucket).wait()


def _weakly(owner: object, method):
    """method(owner, *args) while owner lives, holding owner by a weak reference."""
    ref = weakref.ref(owner)

    def call(*args):
        alive = ref()
        if alive is not None:
            method(alive, *args)

    return call


def broadcast_params(module: torch.nn.Module, dp_group: RankGroup,
                     expert_dp_group: RankGroup | None = None) -> None:  # fmt: skip
    """Copies data-parallel rank 0's parameters of `module` to the other ranks of
    dp_group, expert parameters from expert data-parallel rank 0 over expert_dp_group
    (collective; before FSDP shards a module, or DistributedDataParallel.broadcast_params)."""
    for param in module.parameters():
        group = expert_dp_group if is_expert_parallel(param) else dp_group
        if group.size > 1:
            dist.broadcast(param.data, src=group.ranks[0], group=group.group)


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """The parameter is a routed expert's, split over the expert-parallel ranks."""
    return bool(getattr(param, "expert_parallel", False))
