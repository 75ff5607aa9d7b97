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
After the distributed optimizer's step, start_param_sync() all-gathers every
bucket's parameters; with overlap_param_gather it returns at once and each
module waits for its own parameters in a forward pre-hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mp_optim.config import OptimizerConfig
from mp_optim.grad_buffer import Bucket, GradBuffer
from mp_state import RankGroup

__all__ = ["DistributedDataParallel"]

_DEFAULT_OVERLAP_BUCKET = 40_000_000


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; its parameters' gradients go to buffers reduced over `dp_group`.

    Arguments:
        config: the OptimizerConfig (use_distributed_optimizer, overlap_grad_reduce,
            overlap_param_gather, bucket_size, accumulate_allreduce_grads_in_fp32 /
            bf16, average_in_collective, check_for_nan_in_grad).
        module: the model chunk; its parameters must not change afterwards.
        dp_group: the group gradients are averaged over (`state.dp_cp`, or
            `state.dp` without context parallelism).
    """

    def __init__(self, config: OptimizerConfig, module: torch.nn.Module, *,
                 dp_group: RankGroup) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.module = module
        self.dp_group = dp_group
        bucket_size = config.bucket_size
        if bucket_size is None and config.overlap_grad_reduce:
            bucket_size = max(_DEFAULT_OVERLAP_BUCKET, 1_000_000 * dp_group.size)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = {p: n for n, p in named}
        params = [p for _, p in named]
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in reversed(params):  # about the order the backward produces them
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param.dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        shard = config.use_distributed_optimizer
        self.buffers = [
            GradBuffer(group, grad_dtype, bucket_size=bucket_size, dp_size=dp_group.size,
                       shard_for_dp=shard)
            for (_, grad_dtype), group in by_dtype.items()
        ]  # fmt: skip
        self.buckets: list[Bucket] = [b for buffer in self.buffers for b in buffer.buckets]
        self._bucket_of = {p: b for buffer in self.buffers for p, b in buffer.bucket_of.items()}

        self._sync_enabled = True
        self._empty: set[torch.nn.Parameter] = set(params)  # .main_grad still all zero
        self._ready: list[set[torch.nn.Parameter]] = [set() for _ in self.buckets]
        self._next_launch = 0
        self._grad_work: dict[int, tuple[dist.Work | None, torch.Tensor | None]] = {}
        self._param_work: dict[int, dist.Work] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if config.overlap_param_gather:
            for sub in module.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    self._hooks.append(sub.register_forward_pre_hook(self._wait_params_of))

    # --- the training loop's calls -------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Passes a pipeline stage's input to the wrapped module."""
        self.module.set_input_tensor(tensor)

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
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def finish_grad_sync(self) -> None:
        """Waits until every bucket is reduced (starting those not yet started)."""
        self.start_grad_sync()
        for index, (work, received) in sorted(self._grad_work.items()):
            if work is not None:
                work.wait()
            if received is not None:
                bucket = self.buckets[index]
                shard = bucket.shard(self.dp_group.rank, self.dp_group.size)
                bucket.buffer.grad_data[shard.start : shard.end].copy_(received)
        self._grad_work.clear()
        self._ready = [set() for _ in self.buckets]
        self._next_launch = 0

    def zero_grad_buffer(self) -> None:
        """Zeros the gradient buffers before a new global batch."""
        for buffer in self.buffers:
            buffer.reset()
        for param in self._bucket_of:
            param.grad = None
        self._empty = set(self._bucket_of)
        self._ready = [set() for _ in self.buckets]
        self._next_launch = 0
        self._grad_work.clear()

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """All-gathers every bucket's parameters from the ranks owning their shards.

        For the distributed optimizer, after its step. With overlap_param_gather
        (and not force_sync) the gathers run in the background and each module
        waits for its parameters when its forward starts.
        """
        if not self.config.use_distributed_optimizer or self.dp_group.size == 1:
            return
        self.finish_param_sync()
        rank, size = self.dp_group.rank, self.dp_group.size
        for bucket in reversed(self.buckets):  # the forward needs the last buckets first
            shard = bucket.shard(rank, size)
            mine = bucket.buffer.param_data[shard.start : shard.end].clone()
            self._param_work[bucket.index] = dist.all_gather_into_tensor(
                bucket.param_data, mine, group=self.dp_group.group, async_op=True
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
        data-parallel random initialization)."""
        if self.dp_group.size == 1:
            return
        for param in self.module.parameters():
            dist.broadcast(param.data, src=self.dp_group.ranks[0], group=self.dp_group.group)

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
            ready = self._ready[bucket.index]
            ready.add(param)
            # Buckets start in order, so every rank issues the same collectives.
            while self._next_launch < len(self.buckets) and len(
                self._ready[self._next_launch]
            ) == len(self.buckets[self._next_launch].params):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        grad = bucket.grad_data
        # The reduction writes the whole bucket: a parameter that had no gradient here
        # may hold other ranks' from now on, so only a zero_grad_buffer() empties it again.
        self._empty.difference_update(bucket.params)
        if self.config.check_for_nan_in_grad and not torch.isfinite(grad).all():
            names = [self._names[p] for p in bucket.params if not p.main_grad.isfinite().all()]
            raise RuntimeError(
                f"rank {self.dp_group.global_rank}: non-finite gradient before the data-parallel "
                f"reduction in {', '.join(names)}"
            )
        size = self.dp_group.size
        if size == 1:
            self._grad_work[bucket.index] = (None, None)
            return
        op = dist.ReduceOp.SUM
        if self.config.average_in_collective:
            op = dist.ReduceOp.AVG
        else:
            grad.mul_(1.0 / size)
        group = self.dp_group.group
        if self.config.use_distributed_optimizer:
            received = torch.empty(bucket.numel // size, dtype=grad.dtype, device=grad.device)
            work = dist.reduce_scatter_tensor(received, grad, op=op, group=group, async_op=True)
            self._grad_work[bucket.index] = (work, received)
        else:
            work = dist.all_reduce(grad, op=op, group=group, async_op=True)
            self._grad_work[bucket.index] = (work, None)

    def _wait_params_of(self, module: torch.nn.Module, args) -> None:
        if not self._param_work:
            return
        for param in module.parameters(recurse=False):
            bucket = self._bucket_of.get(param)
            if bucket is not None and bucket.index in self._param_work:
                self._param_work.pop(bucket.index).wait()
